"""A policy bundle on disk, in OPA's format: ``.manifest``, ``data.json`` files, ``*.rego``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy.errors import PolicyError

DEFAULT_BUNDLE_DIR = Path(__file__).parent / "bundles" / "fleet"


@dataclass(frozen=True, slots=True)
class Bundle:
    """The sources and data of one bundle, with a revision derived from its content."""

    root: Path
    modules: tuple[tuple[str, str], ...]
    data: dict[str, Any]
    revision: str

    @property
    def policies(self) -> tuple[tuple[str, str], ...]:
        return tuple(m for m in self.modules if not m[0].endswith("_test.rego"))

    @classmethod
    def load(cls, root: Path = DEFAULT_BUNDLE_DIR) -> Bundle:
        if not root.is_dir():
            raise PolicyError(f"policy bundle {root} does not exist")
        modules = tuple(
            (str(path.relative_to(root)), path.read_text()) for path in sorted(root.rglob("*.rego"))
        )
        data = _load_data(root)
        digest = hashlib.sha256()
        for name, source in modules:
            digest.update(name.encode() + b"\0" + source.encode() + b"\0")
        digest.update(json.dumps(data, sort_keys=True).encode())
        manifest = _manifest(root)
        revision = f"{manifest.get('revision', 'dev')}+{digest.hexdigest()[:12]}"
        return cls(root, modules, data, revision)


def _manifest(root: Path) -> dict[str, Any]:
    path = root / ".manifest"
    if not path.exists():
        return {}
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except ValueError as exc:
        raise PolicyError(f"{path} is not valid JSON") from exc
    return manifest


def _load_data(root: Path) -> dict[str, Any]:
    """Merge every ``data.json`` at the path its folder names (as OPA does)."""
    merged: dict[str, Any] = {}
    for path in sorted(root.rglob("data.json")):
        try:
            document = json.loads(path.read_text())
        except ValueError as exc:
            raise PolicyError(f"{path} is not valid JSON") from exc
        target = merged
        for part in path.parent.relative_to(root).parts:
            target = target.setdefault(part, {})
        target.update(document)
    return merged
