"""The reference documents every command, option, config key and HTTP route."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import pytest

from twinkled.protocol.config import Config
from twinkled.server.cli import main

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def _commands(group: click.Group, prefix: str):
    for name, cmd in group.commands.items():
        path = f"{prefix} {name}"
        yield path, cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, path)


def _command_text(path: str) -> str:
    """What docs/reference.md says about one command: the prose of the `### ` section whose
    heading names it (or its group, for `twinkled ctl ...`), and, for a command listed in
    that section's table, its own rows. Another command's options do not count."""
    sections = re.split(r"^(?=##+ )", REFERENCE, flags=re.M)
    heads = {}  # the command a heading names (its words before any option) -> section
    for sec in sections:
        m = re.match(r"#+ `([^`]*)`", sec)
        if m:
            heads[" ".join(w for w in m.group(1).split() if w.isalpha() and w.islower())] = sec
    words = path.split()
    group = next(" ".join(words[:n]) for n in range(len(words), 0, -1)
                 if " ".join(words[:n]) in heads)
    lines = heads[group].splitlines()
    text = [ln for ln in lines if not ln.startswith("|")]  # the section's prose
    if group == path:
        text += [ln for ln in lines if ln.startswith("| `-")]  # its own option table
    else:
        text += [ln for ln in lines if ln.startswith(f"| `{path}")]  # its own row
    return "\n".join(text)


def test_every_command_and_option_is_documented():
    for path, cmd in _commands(main, "twinkled"):
        assert path in REFERENCE, f"{path} is not in docs/reference.md"
        assert cmd.help, f"{path} has no help text"
        options = [p for p in cmd.params if isinstance(p, click.Option)]
        text = _command_text(path) if options else ""
        for p in options:
            assert any(re.search(rf"{re.escape(o)}(?![\w-])", text) for o in p.opts), \
                f"{path} {p.opts} is not documented in its own section or row"


@pytest.mark.parametrize("client", ["ServiceClient", "TrainingClient", "SamplingClient",
                                    "RestClient", "AdminClient"])
def test_every_sdk_call_is_listed(client):
    """README: every public method of the 0.38 SDK's clients is in the reference, under its
    client (an `X_async` twin through `X`)."""
    tinker = pytest.importorskip("tinker")
    section = REFERENCE.split(f"### {client}\n", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"`([A-Za-z_]\w*)`", section))
    public = {n.removesuffix("_async") for n in dir(getattr(tinker, client))
              if not n.startswith("_")}
    assert public - listed == set(), f"{client} calls missing from docs/reference.md"


def test_every_config_key_is_documented():
    for f in dataclasses.fields(Config):
        assert f"`{f.name}`" in REFERENCE, f"config key {f.name} undocumented"


def test_every_route_is_documented():

    from twinkled.server.app import make_app

    app = make_app(service=None, store=None)
    documented = set(re.findall(r"\| (GET|POST|PUT|DELETE) \| `([^`]+)` \|", REFERENCE))
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        path = re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", route.resource.canonical)
        assert (route.method, path) in documented, f"{route.method} {path} undocumented"


def test_readme_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert block[0].startswith("make demo") and block[1].startswith("make test")
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_cookbook_names_every_script_and_they_exist():
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    scripts = {p.name for p in (root / "cookbook").glob("*.py")} - {"tiny.py"}
    assert scripts, "no cookbook scripts"
    for name in scripts:
        assert f"cookbook/{name}" in readme, f"README does not show cookbook/{name}"
    import re

    for named in re.findall(r"cookbook/([\w.]+\.py)", readme):
        assert (root / "cookbook" / named).is_file(), f"README names missing cookbook/{named}"
