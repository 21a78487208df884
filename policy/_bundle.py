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
        return cls.of(root, modules, _load_data(root), str(_manifest(root).get("revision", "dev")))

    @classmethod
    def of(cls, root: Path, modules: tuple[tuple[str, str], ...], data: dict[str, Any], label: str) -> Bundle:
        """A bundle of these sources and data; its revision is ``label`` (the manifest's revision)
        plus a hash of the content, so that the same name never covers two contents."""
        digest = hashlib.sha256()
        for name, source in modules:
            digest.update(name.encode() + b"\0" + source.encode() + b"\0")
        digest.update(json.dumps(data, sort_keys=True).encode())
        return cls(root, modules, data, f"{label.split('+')[0]}+{digest.hexdigest()[:12]}")

    @property
    def digest(self) -> str:
        """The SHA-256 of the content (all of it: the revision keeps 48 bits of a hash, too few to
        sign), over canonical JSON so that no two contents encode alike."""
        canonical = json.dumps(
            {"modules": [list(m) for m in self.modules], "data": self.data},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    def with_data(self, data: dict[str, Any], label: str | None = None) -> Bundle:
        """The same modules with ``data`` (a new revision)."""
        return Bundle.of(self.root, self.modules, data, label or self.revision)

    def with_modules(self, modules: tuple[tuple[str, str], ...], label: str | None = None) -> Bundle:
        """These modules with the same data (a new revision)."""
        return Bundle.of(self.root, modules, self.data, label or self.revision)


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
