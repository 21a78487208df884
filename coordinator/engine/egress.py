"""What of a step's input may leave the fleet: the input as *paths*, and the input cut down to the
paths the egress policy names (``fleet.egress.decision``; see :mod:`coordinator.engine.delegation`).

A path names a leaf of the input: object keys joined by ``.``, with ``[]`` after a key whose value
is a list (every element of it): ``{"lines": [{"sku": "A"}]}`` has the one path ``lines[].sku``.
Lists collapse, so the paths describe the input's shape, not its size. A key that a path could not
name unambiguously (empty, or holding ``.``, ``[`` or ``]``) is never sent, nor anything under it:
policy could not have named it. What is not sent leaves no trace: an object or list left empty is
dropped too, so the agent does not learn which fields were held back.
"""

from __future__ import annotations

from typing import Any

MAX_PATHS = 1000  # distinct paths of one step's input that the egress policy is asked about
_RESERVED = frozenset(".[]")


def nameable(key: str) -> bool:
    """Whether a path can name ``key`` unambiguously."""
    return bool(key) and not (_RESERVED & set(key))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def leaf_paths(payload: dict[str, Any]) -> tuple[set[str], set[str]]:
    """The paths of ``payload``'s leaves, and the paths (as far as they go) of the keys no path can
    name (see the module's doc), which are never sent."""
    paths: set[str] = set()
    unnameable: set[str] = set()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if nameable(str(key)):
                    walk(item, _join(path, str(key)))
                else:
                    unnameable.add(_join(path, repr(key)))
        elif isinstance(value, list):
            for item in value:
                walk(item, path + "[]")
        else:
            paths.add(path)

    walk(payload, "")
    return paths, unnameable


def keep_paths(payload: dict[str, Any], send: set[str]) -> dict[str, Any]:
    """``payload`` with only the leaves whose path is in ``send`` (and the objects and lists on the
    way to them); empty objects and lists dropped."""
    kept, value = _keep(payload, "", send)
    return value if kept and isinstance(value, dict) else {}


def _keep(value: Any, path: str, send: set[str]) -> tuple[bool, Any]:
    if isinstance(value, dict):
        found: dict[str, Any] = {}
        for key, item in value.items():
            if not nameable(str(key)):
                continue
            kept, sub = _keep(item, _join(path, str(key)), send)
            if kept:
                found[key] = sub
        return bool(found), found
    if isinstance(value, list):
        items = []
        for item in value:
            kept, sub = _keep(item, path + "[]", send)
            if kept:
                items.append(sub)
        return bool(items), items
    return path in send, value
