"""The CLI as a new operator meets it: ctl refuses a data dir that is not one (a typo would
hand out a key no daemon accepts), a busy port is one line and exit 2, -h and --version
work, and ctl's tables say what their columns are."""

from __future__ import annotations

import socket
import subprocess
import sys

from click.testing import CliRunner

from twinkled.server.cli import main


def _ctl(*args: str):
    return CliRunner().invoke(main, ["ctl", *args])


def test_ctl_refuses_an_unknown_data_dir_without_create(tmp_path):
    typo = tmp_path / "twinkel"
    r = _ctl("--data-dir", str(typo), "keys", "create", "--tenant", "sam")
    assert r.exit_code == 1
    assert str(typo) in r.output and "--create" in r.output and "tml-" not in r.output
    assert not (typo / "twinkle.db").exists()
    made = _ctl("--data-dir", str(typo), "--create", "keys", "create", "--tenant", "sam")
    assert made.exit_code == 0, made.output
    assert f"data dir {typo}" in made.output  # says where the key lives
    assert made.output.strip().splitlines()[-1].startswith("tml-")
    again = _ctl("--data-dir", str(typo), "keys", "list")  # now it is one: no --create needed
    assert again.exit_code == 0 and "sam" in again.output


def test_a_busy_port_is_one_line_and_exit_2(tiny_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "twinkled", "serve", "--model", str(tiny_dir),
                            "--data-dir", str(tmp_path), "--port", str(port), "--device",
                            "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "in use" in lines[0], lines


def test_h_and_version():
    runner = CliRunner()
    for args in (["-h"], ["ctl", "-h"], ["ctl", "keys", "create", "-h"], ["serve", "-h"]):
        r = runner.invoke(main, args)
        assert r.exit_code == 0 and r.output.startswith("Usage: "), (args, r.output)
    r = runner.invoke(main, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("twinkled 0."), r.output


def test_ctl_tables_have_headers(tmp_path):
    data = str(tmp_path)
    assert _ctl("--data-dir", data, "--create", "tenants", "set", "sam", "--weight",
                "3").exit_code == 0
    _ctl("--data-dir", data, "keys", "create", "--tenant", "sam")
    for args, header in ((["keys", "list"], ["key", "tenant", "created", "state"]),
                         (["tenants", "list"], ["tenant", "weight", "storage used", "quotas"]),
                         (["runs", "list"], ["run", "tenant", "rank", "loaded", "last request"]),
                         (["checkpoints", "list"], ["checkpoint", "status", "size", "created"])):
        r = _ctl("--data-dir", data, *args)
        assert r.exit_code == 0, r.output
        first = r.output.splitlines()[0]
        assert first.split() == " ".join(header).split(), (args, first)
    assert _ctl("--data-dir", data, "tenants", "list").output.splitlines()[1].split()[:2] == \
        ["sam", "3"]
