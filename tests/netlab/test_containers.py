"""The fleet in containers of the project's own image: the image built with no registry (a Debian base
made with debootstrap, the pinned wheels, the project's own wheel), every service of the compose file
run by Docker from it, and the demo, run from a container on the fleet's network against them, passes.

Running it this way found what the compose file had never been run to show: Docker mounts a tmpfs
noexec (the sandbox server runs bubblewrap from /tmp) and masks /proc paths (bubblewrap could not
mount a proc); the compose file now says ``/tmp:exec`` and ``systempaths=unconfined`` for it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from deploy import image
from fleetctl.testing.containers import ContainerFleet, docker, ensure_docker


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Docker's daemon: the machine's, or one started for these tests and stopped after them."""
    assert os.geteuid() == 0, "building the image (debootstrap, chroot) and running Docker need root"
    for tool in ("docker", "dockerd", "debootstrap"):
        assert shutil.which(tool), f"{tool} is missing (scripts/dev test installs docker.io and debootstrap)"
    started = ensure_docker(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    yield
    if started is not None:
        started.terminate()
        started.wait(timeout=60)


@pytest.fixture(scope="module")
def built(daemon: None) -> str:
    """The image, built from this tree (the base and the dependencies are cached between builds)."""
    return image.build()


@pytest.fixture(scope="module")
def fleet(built: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ContainerFleet]:
    work = tmp_path_factory.mktemp("containers")
    with ContainerFleet(work) as running:
        yield running


def test_every_service_runs_from_the_project_s_image_as_its_own_user(fleet: ContainerFleet) -> None:
    for name in fleet.services:
        shown = docker(
            "inspect", "--format", "{{.Config.Image}} {{.State.Running}} {{.HostConfig.ReadonlyRootfs}}",
            fleet.container(name),
        ).stdout.split()  # fmt: skip
        assert shown == [image.DEFAULT_TAG, "true", "true"], (name, shown)
        assert docker("exec", fleet.container(name), "id", "-u").stdout.strip() == str(image.UID)
    # Postgres is on the data network only: a specialist's container cannot reach it.
    reach = "import socket; socket.create_connection(('postgres', 5432), timeout=3)"
    assert docker("exec", fleet.container("stats"), "python", "-c", reach, check=False).returncode != 0
    assert docker("exec", fleet.container("mcp-cases"), "python", "-c", reach, check=False).returncode == 0


def test_the_demo_passes_against_the_containers(fleet: ContainerFleet) -> None:
    demo = fleet.fleet_cli("demo", "--data-dir", "/operator", "--auto-approve", "--timeout", "300")
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "demo: OK" in demo.stdout
    assert "scored in the sandbox by code-runner" in demo.stdout  # bubblewrap, inside a container
