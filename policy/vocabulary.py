"""The run's vocabulary as policy data (``data.vocabulary`` in the Rego bundles).

``policy/bundles/fleet/vocabulary/data.json`` is generated from :mod:`fleet.vocabulary`: the signal
actions that ``fleet.approvals`` accepts, and the run event types. Regenerate it after changing the
vocabulary with ``python -m policy.vocabulary``; ``tests/unit/test_vocabulary.py`` fails while the
file and the code disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

from fleet.vocabulary import policy_data
from policy._bundle import DEFAULT_BUNDLE_DIR

DATA_FILE = DEFAULT_BUNDLE_DIR / "vocabulary" / "data.json"


def render() -> str:
    """The data file's text, as the code says it should be."""
    return json.dumps(policy_data(), indent=2) + "\n"


def write(path: Path = DATA_FILE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())


if __name__ == "__main__":
    write()
    print(f"wrote {DATA_FILE}")
