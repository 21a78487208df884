"""The fleet's image built with no registry: what ``deploy/Dockerfile`` builds, made from Debian's
packages and the project's pinned wheels instead of a ``python:3.11-slim`` base that cannot be pulled.

    python -m deploy.image build [--tag agent-fleet:dev] [--cache DIR]

1. **The base**: a Debian bookworm root file system made with ``debootstrap`` (``minbase``, with
   Python 3.11, ``venv``, CA certificates, bubblewrap and util-linux, as the Dockerfile installs),
   with the Dockerfile's user (``fleet``, uid 10001) and folders. Made once and kept in the cache.
2. **The dependencies**: every pinned wheel (``pip wheel -c constraints.txt``, on this machine, from
   the package index) installed into ``/opt/fleet`` inside the base (a chroot, no index there).
   Kept in the cache, keyed by ``pyproject.toml`` and ``constraints.txt``.
3. **The project**: its own wheel, built from the tree now, installed on top (``--no-deps``).

The tree is imported into Docker (``docker import``) with the Dockerfile's settings: ``PATH`` with
``/opt/fleet/bin``, user 10001, ``/home/fleet``, port 8080, entrypoint ``fleet``. What differs from
the Dockerfile's image: Debian's ``/usr/bin/python3.11`` (3.11.2) instead of the official image's
``/usr/local/bin/python3.11``; the sandbox server runs untrusted code with ``/usr/bin/python3``
(``mcp_servers.sandbox.runner.find_python``), which is there.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TAG = "agent-fleet:dev"
DEFAULT_CACHE = Path("/var/cache/agent-fleet")
MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "ca-certificates", "bubblewrap", "util-linux")
UID = 10001
SETTINGS = (
    "ENV PATH=/opt/fleet/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV PYTHONDONTWRITEBYTECODE=1",
    "ENV PYTHONUNBUFFERED=1",
    f"USER {UID}:{UID}",
    "WORKDIR /home/fleet",
    "EXPOSE 8080",
    'ENTRYPOINT ["fleet"]',
    'CMD ["--help"]',
)


def _run(*argv: str | Path, **options: object) -> None:
    subprocess.run([str(a) for a in argv], check=True, **options)  # type: ignore[call-overload]


def _chroot(root: Path, *argv: str) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    _run("chroot", root, *argv, env=env, stdout=subprocess.DEVNULL)


def _made_once(root: Path, make: Callable[[Path], None]) -> Path:
    """``root``, made by ``make`` in a folder beside it first (renamed when complete, so a build
    stopped half way leaves nothing that looks made); kept once made."""
    if (root / ".complete").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    making = root.with_name(root.name + ".making")
    shutil.rmtree(making, ignore_errors=True)
    make(making)
    (making / ".complete").touch()
    making.rename(root)
    return root


def base(cache: Path) -> Path:
    """The Debian base with the Dockerfile's user and folders (made once)."""
    key = hashlib.sha256(f"{SUITE} {MIRROR} {' '.join(PACKAGES)} {UID}".encode()).hexdigest()[:12]

    def make(making: Path) -> None:
        _run("debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, making, MIRROR)
        _chroot(making, "groupadd", "--system", "--gid", str(UID), "fleet")
        _chroot(
            making, "useradd", "--system", "--uid", str(UID), "--gid", "fleet", "--home-dir", "/home/fleet",
            "--create-home", "--shell", "/usr/sbin/nologin", "fleet",
        )  # fmt: skip
        for folder in ("var/lib/fleet", "run/fleet/identity", "run/fleet/enrollment", "run/fleet/secrets"):
            (making / folder).mkdir(parents=True, exist_ok=True)
            shutil.chown(making / folder, UID, UID)
        shutil.chown(making / "run/fleet", UID, UID)
        _run("rm", "-rf", making / "var/cache/apt/archives", making / "var/lib/apt/lists")

    return _made_once(cache / f"base-{key}", make)


def with_dependencies(cache: Path) -> Path:
    """The base with every pinned dependency in ``/opt/fleet`` (made once per pin set)."""
    pins = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + (REPO / "constraints.txt").read_bytes())

    def make(making: Path) -> None:
        _run("cp", "-a", base(cache), making)
        wheels = making / "tmp" / "wheels"
        _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--constraint", REPO / "constraints.txt",
             "--wheel-dir", wheels, REPO)  # fmt: skip
        shutil.copy(REPO / "constraints.txt", making / "tmp" / "constraints.txt")
        for project in wheels.glob("agent_fleet-*.whl"):
            project.unlink()  # the project itself goes in last, built from the tree each time
        _chroot(making, "python3", "-m", "venv", "/opt/fleet")
        _chroot(
            making, "/opt/fleet/bin/pip", "install", "--quiet", "--no-index", "--find-links", "/tmp/wheels",
            "--constraint", "/tmp/constraints.txt", *(f"/tmp/wheels/{w.name}" for w in sorted(wheels.glob("*.whl"))),
        )  # fmt: skip
        shutil.rmtree(wheels)

    return _made_once(cache / f"deps-{pins.hexdigest()[:12]}", make)


def build(tag: str = DEFAULT_TAG, cache: Path = DEFAULT_CACHE) -> str:
    """Build the image and import it into Docker as ``tag``; its id."""
    cache.mkdir(parents=True, exist_ok=True)
    deps = with_dependencies(cache)
    with tempfile.TemporaryDirectory(dir=cache) as work:
        root = Path(work) / "root"
        _run("cp", "-a", deps, root)
        wheel_dir = root / "tmp" / "project"
        _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", wheel_dir, REPO)
        (wheel,) = wheel_dir.glob("agent_fleet-*.whl")
        _chroot(
            root,
            "/opt/fleet/bin/pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            f"/tmp/project/{wheel.name}",
        )
        _chroot(root, "/opt/fleet/bin/fleet", "--help")
        shutil.rmtree(wheel_dir)
        (root / ".complete").unlink(missing_ok=True)
        changes = [arg for setting in SETTINGS for arg in ("--change", setting)]
        with subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE) as tar:
            imported = subprocess.run(
                ["docker", "import", *changes, "-", tag],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
                check=False,
            )
    if imported.returncode != 0 or tar.returncode != 0:
        raise RuntimeError(f"docker import failed: {imported.stderr.strip()}")
    return imported.stdout.strip()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.image", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    building = commands.add_parser("build", help="build the image and import it into Docker")
    building.add_argument("--tag", default=DEFAULT_TAG)
    building.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    print(build(args.tag, args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
