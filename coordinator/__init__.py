"""The coordinator: the A2A front door of the fleet. It turns a request into a plan, runs the plan as
a LangGraph graph checkpointed in Postgres (the run id is the A2A task id and the graph's thread id),
and delegates each step over A2A to a specialist it discovers in the registry by skill."""
