"""What the project's tests and benchmarks share, and what a user testing their own agents can use:
an embedded NATS (:mod:`.nats`) and Postgres (:mod:`.postgres`), a stack started with ``fleet up``
(:mod:`.stack`, :mod:`.e2e`), and calls to it from outside (:mod:`.e2e` for A2A and the run API,
:mod:`.mcp` for MCP tools and service logs). Nothing in the fleet's services imports it.
"""
