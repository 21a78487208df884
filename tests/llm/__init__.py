"""The LLM path: the chat model client, the agent loop, the planner; against a scripted model."""
