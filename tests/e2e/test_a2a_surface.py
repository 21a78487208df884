"""The fleet seen from outside: an external agent with the a2a-sdk client, against the real stack."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from a2a.client import A2AClientError
from a2a.types import GetTaskRequest, TaskState
from a2a.utils.errors import InvalidParamsError, TaskNotFoundError

from fleet.a2a_support import error_of_a2a
from fleetctl.testing.e2e import TWO_STEPS, Stack, fetch_card, send, user_message

pytestmark = pytest.mark.e2e


def customers(result: dict[str, object]) -> set[str]:
    records = result["steps"]["totals"]["records"]  # type: ignore[index]
    return {r["customer"] for r in records}  # type: ignore[attr-defined]


async def test_request_is_answered_through_coordinator_specialists_mcp_and_postgres(stack: Stack) -> None:
    outcome = await send(stack, user_message("check invoices", TWO_STEPS), token=stack.token("coordinator"))
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert customers(outcome.result) == {"Northwind", "Contoso", "Fabrikam", "Tailspin"}
    flagged = outcome.result["steps"]["outliers"]["outliers"]
    assert [o["label"] for o in flagged] == ["Fabrikam"]
    assert "step totals: invoice-totals -> sql-analyst" in outcome.progress
    assert "sql-analyst: querying invoice totals per customer" in outcome.progress


async def test_each_tenant_sees_only_its_own_rows(stack: Stack) -> None:
    token = stack.token("coordinator", tenant="globex")
    outcome = await send(stack, user_message(data=TWO_STEPS), token=token)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert customers(outcome.result) == {"Initech", "Hooli", "Vandelay"}


async def test_tenant_comes_from_the_token_whatever_the_sql_asks_for(stack: Stack) -> None:
    steps = {
        "steps": [
            {
                "skill": "sql-query",
                "input": {"sql": "SELECT DISTINCT tenant_id FROM tenant_data.invoices WHERE tenant_id <> ''"},
            }
        ]
    }
    outcome = await send(stack, user_message(data=steps), token=stack.token("coordinator", tenant="globex"))
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert outcome.result["steps"]["step1"]["records"] == [{"tenant_id": "globex"}]


async def test_a_write_through_the_sql_tool_is_refused_and_changes_nothing(stack: Stack) -> None:
    steps = {"steps": [{"skill": "sql-query", "input": {"sql": "DELETE FROM tenant_data.invoices"}}]}
    outcome = await send(stack, user_message(data=steps), token=stack.token("coordinator"))
    assert outcome.state_name == "TASK_STATE_FAILED"
    assert outcome.final_text.startswith("step step1 (sql-query) failed")
    # The chain, as data: the agent failed the step because the tool refused the write.
    assert outcome.codes[:2] == ["specialist_failed", "tool_failed"], outcome.codes
    assert outcome.codes[2] in ("invalid_request", "sql_refused"), outcome.codes
    after = await send(stack, user_message(data=TWO_STEPS), token=stack.token("coordinator"))
    assert len(customers(after.result)) == 4


async def test_free_text_is_routed_by_policy(stack: Stack) -> None:
    outcome = await send(
        stack, user_message("Any outliers in our invoices?"), token=stack.token("coordinator")
    )
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert set(outcome.result["steps"]) == {"totals", "outliers"}


async def test_skill_no_specialist_offers_is_a_clear_a2a_error_not_a_hang(stack: Stack) -> None:
    message = user_message(data={"steps": [{"skill": "teleport"}]})
    async with asyncio.timeout(20):
        with pytest.raises(InvalidParamsError) as caught:
            await send(stack, message, token=stack.token("coordinator"))
    assert error_of_a2a(caught.value).code == "no_specialist_for_skill"
    assert "teleport" in caught.value.message


async def test_text_that_no_routing_rule_matches_is_a_clear_a2a_error(stack: Stack) -> None:
    with pytest.raises(InvalidParamsError, match="no routing rule matches"):
        await send(stack, user_message("write me a sonnet"), token=stack.token("coordinator"))


def assert_401(exc: A2AClientError) -> None:
    cause = exc.__cause__
    assert isinstance(cause, httpx.HTTPStatusError)
    assert cause.response.status_code == 401
    assert cause.response.headers["www-authenticate"].startswith("Bearer")


async def test_missing_token_gets_401(stack: Stack) -> None:
    with pytest.raises(A2AClientError) as caught:
        await send(stack, user_message(data=TWO_STEPS), token=None)
    assert_401(caught.value)


async def test_expired_token_gets_401(stack: Stack) -> None:
    expired = stack.forge(iat=1_700_000_000, exp=1_700_000_300)
    with pytest.raises(A2AClientError) as caught:
        await send(stack, user_message(data=TWO_STEPS), token=expired)
    assert_401(caught.value)


async def test_token_for_another_audience_gets_401(stack: Stack) -> None:
    with pytest.raises(A2AClientError) as caught:
        await send(stack, user_message(data=TWO_STEPS), token=stack.token("stats"))
    assert_401(caught.value)


async def test_token_from_an_unknown_signer_gets_401(stack: Stack) -> None:
    from fleet.keys import SigningKey

    stranger = SigningKey.generate()
    token = stranger.sign({"iss": "fleet-registry", "sub": "x", "aud": "coordinator", "tenant": "acme"})
    with pytest.raises(A2AClientError) as caught:
        await send(stack, user_message(data=TWO_STEPS), token=token)
    assert_401(caught.value)


async def test_specialists_also_require_their_own_token(stack: Stack) -> None:
    message = user_message(data={"skill": "invoice-totals", "input": {}})
    with pytest.raises(A2AClientError) as caught:
        await send(stack, message, token=stack.token("coordinator"), agent="sql-analyst")
    assert_401(caught.value)
    outcome = await send(stack, message, token=stack.token("sql-analyst"), agent="sql-analyst")
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text


async def test_another_tenant_cannot_read_a_run(stack: Stack) -> None:
    outcome = await send(stack, user_message(data=TWO_STEPS), token=stack.token("coordinator"))
    from a2a.client import ClientCallContext, ClientConfig, ClientFactory

    async with httpx.AsyncClient() as http:
        card = await fetch_card(http, stack.endpoints["coordinator"])
        client = ClientFactory(ClientConfig(httpx_client=http)).create(card)

        def as_tenant(tenant: str) -> ClientCallContext:
            token = stack.token("coordinator", tenant=tenant)
            return ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})

        task = await client.get_task(GetTaskRequest(id=outcome.task_id), context=as_tenant("acme"))
        assert task.status.state == TaskState.TASK_STATE_COMPLETED
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id=outcome.task_id), context=as_tenant("globex"))
        await client.close()


async def test_coordinator_card_is_signed_and_advertises_bearer_auth(stack: Stack) -> None:
    async with httpx.AsyncClient() as http:
        card = await fetch_card(http, stack.endpoints["coordinator"])
    assert len(card.signatures) == 1
    assert card.security_schemes["bearer"].http_auth_security_scheme.scheme == "Bearer"
    flow = card.security_schemes["fleet_oauth"].oauth2_security_scheme.flows.client_credentials
    assert flow.token_url == stack.endpoints["registry"] + "/oauth/token"
    assert list(flow.scopes) == ["agent:invoke"]
    assert card.supported_interfaces[0].url.startswith(stack.endpoints["coordinator"])
