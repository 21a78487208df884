"""``fleet serve SERVICE``: run one service of the platform's roster, or of a project's manifest,
in this process (what a container runs, what ``fleet up`` starts each service as, and what a
service forked by :mod:`fleetctl.forkserver` runs)."""

from __future__ import annotations

import asyncio
import importlib
import sys

from deploy.local_stack import ServiceSpec, service
from deploy.manifest import load as load_manifest
from fleet.settings import FleetSettings, ServiceSettings
from fleetctl.cli_common import EXIT_OK, EXIT_USAGE


def serve(service_id: str) -> int:
    """Run one service of the platform's roster, or of the manifest ``$FLEET_MANIFEST`` names, in
    this process."""
    spec: ServiceSpec | None
    try:
        spec = service(service_id)
    except KeyError:
        manifest = FleetSettings().manifest
        project = load_manifest(manifest) if manifest is not None else None
        spec = next((s for s in project.services if s.id == service_id), None) if project else None
        if project is not None and str(project.root) not in sys.path:
            sys.path.insert(0, str(project.root))
    if spec is None:
        print(f"fleet: unknown service {service_id!r}", file=sys.stderr)
        return EXIT_USAGE
    module_name, _, function_name = spec.entry.partition(":")
    entry = getattr(importlib.import_module(module_name), function_name)
    settings = ServiceSettings.from_env(service_id)
    asyncio.run(entry(settings))
    return EXIT_OK
