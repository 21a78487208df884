"""Planning: a request becomes a plan of steps, given as data or by a planner (policy routing, or a
model: :mod:`.llm_planner`), checked before any run starts (:mod:`.plan`). Imports no other wing."""
