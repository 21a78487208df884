"""Working memory: a run's message channel, kept to the current turn and to a size bound, as the
reducer of a real LangGraph graph's channel."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph

from fleet.working_memory import prune, working_memory


def test_only_the_current_turn_is_kept_with_the_system_prompt() -> None:
    messages = [
        {"role": "system", "content": "You are the analyst."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "second answer"},
    ]
    assert [m["content"] for m in prune(messages)] == [
        "You are the analyst.",
        "second question",
        "second answer",
    ]
    assert len(prune(messages, turns=2)) == 5


def test_the_size_bound_drops_the_oldest_and_keeps_calls_with_their_results() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q" * 10},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r" * 500},
        {"role": "assistant", "content": "a" * 100},
    ]
    kept = prune(messages, max_chars=200)
    assert [m["role"] for m in kept] == ["system", "user", "assistant"]
    assert kept[-1]["content"] == "a" * 100  # the call and its result went together
    assert not any(m.get("role") == "tool" for m in kept)


def test_one_huge_message_is_cut_with_a_marker() -> None:
    [_, user] = prune(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "x" * 50_000}],
        max_message_chars=1_000,
        max_chars=100_000,
    )
    assert len(user["content"]) < 1_100 and user["content"].endswith("of one message]")


def test_as_a_langgraph_channel_the_state_never_grows_past_the_bound() -> None:
    class State(TypedDict):
        messages: Annotated[list[dict[str, Any]], working_memory(max_chars=2_000)]

    def agent(state: State) -> dict[str, Any]:
        return {"messages": [{"role": "assistant", "content": "y" * 300}]}

    graph = StateGraph(State)
    graph.add_node("agent", agent)
    graph.add_edge(START, "agent")
    graph.add_edge("agent", END)
    app = graph.compile()
    state: dict[str, Any] = {"messages": [{"role": "system", "content": "s"}]}
    for turn in range(20):
        state = app.invoke({"messages": [*state["messages"], {"role": "user", "content": f"turn {turn}"}]})
        assert sum(len(m["content"]) for m in state["messages"]) <= 2_000
    assert [m["role"] for m in state["messages"]] == ["system", "user", "assistant"]
    assert state["messages"][1]["content"] == "turn 19"
