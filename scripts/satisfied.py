"""Exit 0 when this interpreter already has what scripts/install.sh would install: torch
2.13.0, this checkout installed editable, every requirement of pyproject.toml (and of the
extras named in INSTALL_EXTRAS) met, and tinker-cookbook 0.6.1 with the cookbook extra.
install.sh then skips pip, whose resolve and editable build cost seconds of CPU in every
`make` target (test_newcomer.py runs four). Any doubt (a missing module, an unreadable
record) exits 1, and pip runs as before."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def _met(req: Requirement, extras: set[str]) -> bool:
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
        return True  # not for this platform / these extras
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = [e for e in os.environ.get("INSTALL_EXTRAS", "").split(",") if e]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    reqs.append(Requirement("torch==2.13.0"))
    if "cookbook" in extras:
        reqs.append(Requirement("tinker-cookbook==0.6.1"))
    if not all(_met(r, {"", *extras}) for r in reqs):
        return 1
    # This checkout, editable, at its current version (not another clone's install), with
    # its current commands, and every top-level package imported from here (an editable
    # install maps the packages it saw: one added since needs pip again).
    dist = metadata.distribution(project["name"])
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if not (url.get("dir_info", {}).get("editable") and url.get("url") == root.as_uri()
            and dist.version == project["version"]):
        return 1
    commands = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    if commands != project.get("scripts", {}):
        return 1
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = setup["packages"]["find"]["include"]
    for pkg in root.iterdir():
        if (pkg / "__init__.py").is_file() and any(fnmatch.fnmatch(pkg.name, p) for p in include):
            spec = importlib.util.find_spec(pkg.name)
            if spec is None or not (spec.origin or "").startswith(str(pkg)):
                return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - any doubt: let pip decide
        sys.exit(1)
