"""handle-ticket: the desk's workflow, a LangGraph graph of its own run by the fleet.

triage -> (urgent: escalate to a person) -> answer. Each ``delegate`` is a step of the run (the
ledger sends it once, however often a node runs again after a crash); the escalation parks the run,
holding no process, until a person answers.
"""

from __future__ import annotations

from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

from coordinator.engine.workflows import delegate


class Ticket(TypedDict, total=False):
    message: str
    ticket: str
    priority: str
    decision: str
    answer: str


async def triage(state: Ticket) -> dict[str, Any]:
    triaged = await delegate("triage-ticket", {"message": state["message"]})
    return {"ticket": triaged["ticket"], "priority": triaged["priority"]}


async def escalate(state: Ticket) -> dict[str, Any]:
    decided = await delegate("escalate", {"ticket": state["ticket"], "message": state["message"]})
    return {"decision": decided["decision"]}


async def answer(state: Ticket) -> dict[str, Any]:
    answered = await delegate("answer-from-kb", {"ticket": state["ticket"], "message": state["message"]})
    return {"answer": answered["answer"]}


def after_triage(state: Ticket) -> str:
    return "escalate" if state.get("priority") == "high" else "answer"


def build() -> StateGraph[Ticket, Any, Any, Any]:
    graph: StateGraph[Ticket, Any, Any, Any] = StateGraph(Ticket)
    graph.add_node("triage", triage)
    graph.add_node("escalate", escalate)
    graph.add_node("answer", answer)
    graph.add_edge(START, "triage")
    graph.add_conditional_edges("triage", after_triage, ["escalate", "answer"])
    graph.add_edge("escalate", "answer")
    graph.add_edge("answer", END)
    return graph
