"""The commands' failures reach the user as one line with a stable code and the exit code of the one
table (``fleetctl.cli_common``), never as a traceback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from deploy.local_stack import OPERATOR_ID
from fleet.errors import ErrorCode, FleetError
from fleet.keys import SigningKey
from fleetctl.cli_common import EXIT_FAILED, exit_code, operator_token_client, report_error
from fleetctl.layout import StackLayout
from fleetctl.policy_cli import push_bundle


async def closed_port() -> int:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return port


async def test_an_unreachable_token_endpoint_is_dependency_unavailable_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layout = StackLayout.at(tmp_path)
    layout.key_file(OPERATOR_ID).parent.mkdir(parents=True, exist_ok=True)
    SigningKey.load_or_create(layout.key_file(OPERATOR_ID))
    token_url = f"http://127.0.0.1:{await closed_port()}/oauth/token"
    async with httpx.AsyncClient(timeout=2) as http:
        tokens = operator_token_client(layout, token_url, http)
        with pytest.raises(FleetError) as caught:
            await tokens.token("console", "acme", ["agent:invoke"])
    assert caught.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE and caught.value.retryable
    assert isinstance(caught.value.__cause__, httpx.ConnectError)
    assert report_error(caught.value, as_json=False) == EXIT_FAILED
    err = capsys.readouterr().err
    assert err == "fleet: cannot reach the registry's token endpoint: ConnectError [dependency_unavailable]\n"


def _bundle_with_a_failing_test(root: Path) -> Path:
    root.mkdir()
    (root / "t.rego").write_text("package t\n\nallow := false\n")
    (root / "t_test.rego").write_text("package t_test\n\nimport data.t\n\ntest_allow if {\n\tt.allow\n}\n")
    return root


@pytest.mark.parametrize(
    ("broken", "why"), [("missing", "does not exist"), ("failing", "1 test(s) of the bundle do not pass")]
)
async def test_a_refused_push_reports_the_exit_code_the_table_gives_its_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], broken: str, why: str
) -> None:
    bundle = tmp_path / "nope" if broken == "missing" else _bundle_with_a_failing_test(tmp_path / "b")
    code = await push_bundle(StackLayout.at(tmp_path / "home"), bundle, "", 1.0, as_json=True)
    error = json.loads(capsys.readouterr().err.splitlines()[-1])["error"]
    assert code == EXIT_FAILED == error["exit_code"]
    assert error["exit_code"] == exit_code(FleetError(ErrorCode(error["code"]), ""))
    assert error["code"] == "policy_unavailable" and error["message"].startswith("refused: ")
    assert why in error["message"]


async def test_a_push_without_a_signing_key_is_refused_before_it_reaches_the_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await push_bundle(StackLayout.at(tmp_path / "home"), None, "", 1.0, as_json=True)
    error = json.loads(capsys.readouterr().err.splitlines()[-1])["error"]
    assert code == EXIT_FAILED == error["exit_code"]
    assert error["code"] == "policy_unavailable" and error["message"].startswith(
        "refused: no signing key at "
    )
