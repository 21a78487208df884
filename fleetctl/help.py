"""What ``fleet ... --help`` shows besides each command's options: an example of every command, and
a line for every positional argument. Kept in one table so that a new command without an example
fails its test (tests/unit/test_cli_help.py) instead of shipping bare."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

EXAMPLES: dict[str, tuple[str, ...]] = {
    "up": ("fleet up --detach", "cd my-project && fleet up    # the fleet of ./fleet.toml"),
    "down": ("fleet down",),
    "status": ("fleet status", "fleet status --json | jq .services"),
    "token": ("fleet token --audience coordinator --tenant acme --scope agent:invoke",),
    "console": ("fleet console --tenant acme",),
    "demo": ("fleet demo", "fleet demo --auto-approve --timeout 300"),
    "logs": ("fleet logs coordinator", "fleet logs triage --follow", "fleet logs --list"),
    "runs": ("fleet runs list --tenant acme", "fleet runs start --plan plan.json --tenant acme --follow"),
    "runs list": ("fleet runs list --tenant acme --state waiting",),
    "runs start": (
        "fleet runs start --plan plan.json --tenant acme --follow",
        'echo \'{"steps": [{"id": "t", "skill": "outliers", "input": {...}}]}\' | fleet runs start --plan -',
        'fleet runs start "check the invoices" --tenant acme',
        'fleet runs start --workflow handle-ticket --input \'{"message": "Checkout is down"}\' --follow',
    ),
    "runs show": ("fleet runs show RUN_ID --tenant acme --watch",),
    "runs events": ("fleet runs events RUN_ID --tenant acme --follow",),
    "runs cancel": ("fleet runs cancel RUN_ID --tenant acme --reason 'wrong input'",),
    "runs export": ("fleet runs export RUN_ID ./bundle --tenant acme",),
    "runs resolve": ("fleet runs resolve RUN_ID OP_ID succeeded --tenant acme --note 'refund went out'",),
    "runs decide": ("fleet runs decide RUN_ID tranche --max-steps 50 --tenant acme --note 'one more batch'",),
    "runs extend": ("fleet runs extend RUN_ID --seconds 3600 --tenant acme",),
    "approve": ("fleet approve RUN_ID --tenant acme --note 'checked the amounts'",),
    "reject": ("fleet reject RUN_ID --tenant acme --note 'not this customer'",),
    "events": ("fleet events publish fleet.events.acme.erp.invoice --tenant acme --source erp --data '{}'",),
    "events publish": (
        "fleet events publish fleet.events.acme.erp.invoice --tenant acme --source erp --type invoice.late"
        " --id inv-42 --data '{\"invoice\": 42}'",
    ),
    "producers": ("fleet producers issue erp --tenant acme --source erp --out erp.creds",),
    "producers issue": ("fleet producers issue erp --tenant acme --source erp --days 30 --out erp.creds",),
    "producers revoke": ("fleet producers revoke erp --reason 'key leaked'",),
    "producers list": ("fleet producers list --json",),
    "keys": ("fleet keys revoked",),
    "keys revoke": ("fleet keys revoke KID --reason 'laptop lost'",),
    "keys rotate-registry": ("fleet keys rotate-registry",),
    "keys revoked": ("fleet keys revoked --json",),
    "keys enrollment-token": ("fleet keys enrollment-token partner-agent --external --skill translate",),
    "policy": ("fleet policy test", "fleet policy push ./my-bundle --note 'refund threshold 500'"),
    "policy test": ("fleet policy test", "fleet policy test ./my-bundle"),
    "policy eval": (
        "fleet policy eval data.fleet.tools.decision --input call.json",
        "fleet policy eval 'd := data.fleet.tools.decision; not d.allow' --input call.json",
    ),
    "policy fmt": ("fleet policy fmt ./my-bundle", "fleet policy fmt --check ./my-bundle"),
    "policy push": ("fleet policy push ./my-bundle --note 'refund threshold 500' --wait 30",),
    "policy rollback": ("fleet policy rollback",),
    "policy authorize": ("fleet policy authorize ada --key ada.jwk.json --days 90",),
    "policy status": ("fleet policy status",),
    "policy log": ("fleet policy log --follow", "fleet policy log --last 20 --json"),
    "policy serve": ("fleet policy serve --port 8181",),
    "memory": ('fleet memory search "who approves refunds?" --tenant acme',),
    "memory search": ('fleet memory search "who approves refunds?" --tenant acme',),
    "memory show": ("fleet memory show ENTRY_ID --tenant acme",),
    "memory forget": ("fleet memory forget --run RUN_ID --tenant acme --reason 'bad data'",),
    "memory approve": ("fleet memory approve ENTRY_ID --tenant acme",),
    "memory audit": ("fleet memory audit --tenant acme",),
    "agents": ("fleet agents list",),
    "agents list": ("fleet agents list --json",),
    "agents show": ("fleet agents show sql-analyst",),
    "mcp": ("fleet mcp list",),
    "mcp list": ("fleet mcp list --json",),
    "deploy": ("fleet deploy render",),
    "deploy render": ("fleet deploy render", "fleet deploy render --check    # in CI: the files are current"),
    "new": (
        "fleet new specialist triage",
        "fleet new mcp-server tickets --dir ./support-desk",
        "fleet new workflow handle-ticket",
    ),
    "serve": ("fleet serve registry    # what fleet up runs, one process per service",),
}

# Help for positional arguments, by their name (argparse's dest).
POSITIONALS: dict[str, str] = {
    "run_id": "the run's id (fleet runs list)",
    "op_id": "the operation's id (fleet runs show RUN_ID)",
    "out_dir": "the folder to write (default: ./run-RUN_ID)",
    "verdict": "what became of the operation",
    "decision": "what the run does at its decision point",
    "subject": "the NATS subject: fleet.events.TENANT.SOURCE.TYPE",
    "producer": "the event producer's name",
    "kid": "the key's id (its JWK kid)",
    "identity": "the identity that may enroll (a service or a partner agent's id)",
    "dir": "a policy bundle folder",
    "query": "what to ask",
    "author": "the policy author's name",
    "ids": "memory entry ids",
    "id": "a memory entry id",
    "agent_id": "the agent's id (fleet agents list)",
    "service_id": "a service of the stack (fleet status lists them)",
    "service": "a service of the stack, or nats, postgres, supervisor",
    "text": "what to do, in words: the coordinator plans it",
    "kind": "what to make",
    "name": "its name: lowercase letters, digits and dashes (an MCP server's gets mcp- in front)",
}


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command under ``parser``, as ("runs start", its parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield " ".join((*path, name)), sub
                yield from commands(sub, (*path, name))


def with_examples(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with every command's examples as its epilog, and every positional argument that
    has no help given one from :data:`POSITIONALS`."""
    parser.epilog = (
        "examples:\n  fleet up --detach && fleet demo\n  fleet runs start --plan plan.json --follow"
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for name, sub in commands(parser):
        examples = EXAMPLES.get(name)
        if examples:
            sub.epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
            sub.formatter_class = argparse.RawDescriptionHelpFormatter
        for action in sub._actions:
            if not action.option_strings and action.help is None and action.dest in POSITIONALS:
                action.help = POSITIONALS[action.dest]
    return parser


__all__ = ["EXAMPLES", "POSITIONALS", "commands", "with_examples"]
