"""Operator files: the example config, `check_config`, the systemd unit, the image, the guide.

Fast, CPU only, offline: nothing is installed and nothing is built; the install chain is
run with a stand-in `python3` that records what pip would have been asked to do.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from twinkled.protocol.config import Config, check_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "ops" / "twinkled.toml"
UNIT = ROOT / "ops" / "twinkled.service"
GUIDE = (ROOT / "docs" / "operator.md").read_text()


# -- the example config and check_config ----------------------------------------------------


def test_example_config_sets_every_key_and_checks_clean():
    raw = tomllib.loads(EXAMPLE.read_text())
    assert set(raw) == {f.name for f in dataclasses.fields(Config)}
    assert raw["tenants"], "the example shows a [tenants.NAME] table"
    assert check_config(EXAMPLE) == []
    cfg = Config.load(EXAMPLE)  # what the checker passes, the daemon loads
    assert cfg.worker_devices() == ["cuda:0", "cuda:1"]
    assert (cfg.log_format, cfg.admin_key_file) == ("text", "")


def test_every_key_has_a_comment_with_its_default():
    """Each top-level key, and the first [tenants.NAME] table, sits under its own comment
    lines, and they give the default."""
    lines = EXAMPLE.read_text().splitlines()
    first_table = next(i for i, ln in enumerate(lines) if ln.startswith("["))
    documented = []
    for i, line in enumerate(lines[:first_table + 1]):
        m = re.match(r"(\w+) = |\[(tenants)\.", line)
        if not m:
            continue
        above = []
        for prev in reversed(lines[:i]):
            if not prev.startswith("#"):
                break
            above.append(prev)
        assert any("Default" in c for c in above), f"{m[1] or m[2]}: no comment with its default"
        documented.append(m[1] or m[2])
    assert sorted(documented) == sorted(f.name for f in dataclasses.fields(Config))


def _check(tmp_path, text: str) -> list[str]:
    path = tmp_path / "twinkled.toml"
    path.write_text(text)
    return check_config(path)


def test_a_small_good_file_is_fine(tmp_path):
    assert _check(tmp_path, 'model = "/m"\nport = 9000\nstep_timeout_s = 60\n'
                            'devices = ["cpu"]\nlog_format = "json"\n'
                            '[tenants.bob]\nweight = 1\nmax_adapters = 2\n') == []


@pytest.mark.parametrize("text, key, says", [
    ("prot = 8000", "prot", "did you mean 'port'"),
    ("max_queued_requests = 8", "max_queued_requests", "did you mean 'tenant_max_queued_requests'"),
    ("zzz = 1", "zzz", "known keys"),
    ('port = "8000"', "port", "must be an integer, got a string"),
    ("port = 80.5", "port", "must be an integer"),
    ("workers = true", "workers", "got a boolean"),
    ("model = 3", "model", "must be a string"),
    ('devices = "cuda:0"', "devices", "array of strings"),
    ("devices = [0, 1]", "devices", "array of strings"),
    ("tenants = 3", "tenants", "must be a table"),
    ("port = 0", "port", "1 to 65535"),
    ("port = 70000", "port", "1 to 65535"),
    ('dtype = "fp16"', "dtype", "bfloat16, float32 or float16"),
    ('device = "gpu"', "device", "cpu, cuda, cuda:N or auto"),
    ('devices = ["cuda:0", "auto"]', "devices", "'auto'"),
    ('devices = ["cuda:1", "cuda:1"]', "devices", "twice"),
    ("token_budget = 0", "token_budget", "positive"),
    ("sample_budget = -5", "sample_budget", "positive"),
    ("max_rank = 0", "max_rank", "positive"),
    ("workers = 0", "workers", "positive"),
    ("drain_timeout_s = -1", "drain_timeout_s", "0 or more"),
    ("gather_ms = -0.5", "gather_ms", "0 or more"),
    ("step_timeout_s = 0", "step_timeout_s", "positive"),
    ("poll_seconds = 60", "poll_seconds", "45"),
    ("tenant_max_rank = 0", "tenant_max_rank", "positive integer"),
    ('log_format = "yaml"', "log_format", "text or json"),
    ('admin_key_file = 7', "admin_key_file", "string"),
    ("[tenants]\nalice = 2", "tenants.alice", "must be a table"),
    ('[tenants.alice]\nweight = "heavy"', "tenants.alice.weight", "must be a number"),
    ("[tenants.alice]\nweight = 0", "tenants.alice.weight", "positive"),
    ("[tenants.alice]\nmax_rank = 1.5", "tenants.alice.max_rank", "integer"),
    ("[tenants.alice]\nmax_adapters = -1", "tenants.alice.max_adapters", "positive"),
    ("[tenants.alice]\nwieght = 2", "tenants.alice.wieght", "did you mean 'weight'"),
    ("[tenants.alice]\ntenant_max_rank = 8", "tenants.alice.tenant_max_rank", "'max_rank'"),
    ("[tenants.alice]\nport = 8001", "tenants.alice.port", "before the first [table]"),
])
def test_each_bad_value_is_named(tmp_path, text, key, says):
    problems = _check(tmp_path, text + "\n")
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{key}: "), problems
    assert says in problems[0], problems


def test_every_problem_in_a_file_is_reported(tmp_path):
    problems = _check(tmp_path, 'prot = 1\nport = "x"\ndtype = "int8"\nworkers = 2\n'
                                "[tenants.a]\nweight = -1\nbogus = 1\n")
    assert [p.split(":")[0] for p in problems] == [
        "prot", "port", "dtype", "tenants.a.weight", "tenants.a.bogus"]


def test_toml_syntax_error_gives_the_line(tmp_path):
    problems = _check(tmp_path, 'port = 8000\nhost = "0.0.0.0\nworkers = 2\n')
    assert len(problems) == 1 and "TOML syntax error" in problems[0]
    assert "line 2" in problems[0], problems


def test_unreadable_file_is_a_problem_not_an_exception(tmp_path):
    problems = check_config(tmp_path / "missing.toml")
    assert len(problems) == 1 and "cannot read" in problems[0]


# -- the systemd unit -------------------------------------------------------------------------


def _unit() -> dict[str, str]:
    settings = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def test_unit_stops_by_draining_and_keeps_the_gpus():
    unit = _unit()
    assert unit["KillMode"] == "mixed" and unit["KillSignal"] == "SIGTERM"
    drain = tomllib.loads(EXAMPLE.read_text())["drain_timeout_s"]
    assert int(unit["TimeoutStopSec"]) >= drain + 60, "room to persist after the drain"
    assert "PrivateDevices" not in unit and "DevicePolicy" not in unit
    assert unit["ExecStart"].split()[1:] == ["serve", "--config", "/etc/twinkle/twinkled.toml"]
    assert unit["User"] == "twinkle" and unit["StateDirectory"] == "twinkle"


def _verify(unit_text: str, tmp_path) -> tuple[int, list[str]]:
    path = tmp_path / "twinkled.service"
    path.write_text(unit_text)
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                         text=True, timeout=60)
    return out.returncode, [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    text = UNIT.read_text()
    # On this box the venv is not installed: point ExecStart at an executable that exists.
    exe = os.path.realpath(sys.executable)
    runnable = re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", text, flags=re.M)
    rc, lines = _verify(runnable, tmp_path)
    # The service user need not exist here either; nothing else may be reported.
    lines = [ln for ln in lines if not re.search(r"user|User=", ln) or "twinkle" not in ln]
    assert lines == [] and rc == 0, lines
    # And the unit as shipped: the missing binary is the only complaint.
    rc, lines = _verify(text, tmp_path)
    lines = [ln for ln in lines if not re.search(r"user|User=", ln) or "twinkle" not in ln]
    assert all("/opt/twinkle/venv/bin/twinkled" in ln for ln in lines), lines


# -- one install path: README, CI and the image ------------------------------------------------


@pytest.fixture()
def fake_python(tmp_path):
    """A `python3` first on PATH that logs its cwd and arguments instead of running."""
    bin_dir, log = tmp_path / "bin", tmp_path / "python3.log"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    # install.sh reads pyproject.toml's dependency list with python -c (tomllib): that one
    # runs for real, so the pip call that follows shows what it would install. Its check
    # that all is already installed (scripts/satisfied.py) says no: pip's calls are shown.
    fake.write_text('#!/bin/sh\ncase "$2" in *tomllib*) exec "$REAL_PYTHON" "$@";; esac\n'
                    'case "$1" in *satisfied.py) exit 1;; esac\n'
                    '{ printf "%s" "$PWD"; for a in "$@"; do printf "\\t%s" "$a"; '
                    'done; printf "\\n"; } >> "$FAKE_PYTHON_LOG"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON", "INSTALL_EXTRAS", "INSTALL_EDITABLE", "MAKEFLAGS", "MFLAGS",
                        "MAKELEVEL")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_PYTHON_LOG=str(log),
               REAL_PYTHON=sys.executable)
    assert shutil.which("python3", path=env["PATH"]) == str(fake)  # never the real one

    def run(command: list[str] | str, **kw) -> list[list[str]]:
        log.write_text("")
        subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=60,
                       shell=isinstance(command, str), capture_output=True, **kw)
        return [line.split("\t") for line in log.read_text().splitlines()]

    return run


def _pip_install(calls: list[list[str]], cookbook: bool = False) -> list[str]:
    """The one `python3 -m pip install ...` call that installs the project (with torch
    pinned), run at the repo root: its arguments. With `cookbook`, it must be followed by
    the one install of tinker-cookbook without its dependencies (their pins include
    another torch); without, there is no other install."""
    installs = [c for c in calls if c[1:4] == ["-m", "pip", "install"]]
    assert len(installs) == (2 if cookbook else 1), calls
    assert Path(installs[0][0]) == ROOT
    if cookbook:
        assert installs[1][-2:] == ["--no-deps", "tinker-cookbook==0.6.1"], installs[1]
    return installs[0][4:]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_ci_and_readme_run_the_install_script_then_the_tests(fake_python):
    via_ci = fake_python([str(ROOT / ".ci" / "run")])
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    test_line = next(ln for ln in block.splitlines() if "test" in ln.split("#")[0])
    via_readme = fake_python(test_line.split("#")[0].strip())
    assert via_ci == via_readme
    args = _pip_install(via_ci, cookbook=True)
    assert "torch==2.13.0" in args and args[-2:] == ["-e", ".[test,cookbook]"]  # the default
    assert via_ci[-1][1:3] == ["-m", "pytest"], "the tests run after the install"


def test_outside_a_venv_make_installs_into_a_project_venv(tmp_path):
    # A stock Debian/Ubuntu python3 refuses system-wide pip installs (PEP 668): the README's
    # commands install into the project's .venv unless a virtual environment is active.
    base = Path(sys.base_prefix) / "bin" / "python3"
    if not base.exists():
        pytest.skip("no base interpreter to make a venv from")
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "python.sh", project / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(base)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"

    def which() -> str:
        return subprocess.run(["bash", str(project / "scripts" / "python.sh")], env=env,
                              check=True, capture_output=True, text=True,
                              timeout=300).stdout.strip()

    made = which()
    assert made == str(project / ".venv" / "bin" / "python")
    prefix = subprocess.run([made, "-c", "import sys; print(sys.prefix)"], check=True,
                            capture_output=True, text=True).stdout.strip()
    assert Path(prefix) == project / ".venv"
    assert which() == made  # made once, then reused
    # Inside an active venv, that venv's python3 is used; $PYTHON overrides both.
    active = tmp_path / "active"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(active)], check=True,
                   timeout=120)
    env["PATH"] = f"{active / 'bin'}{os.pathsep}{env['PATH']}"
    assert which() == str(active / "bin" / "python3")
    env["PYTHON"] = "/opt/twinkle/bin/python"
    assert which() == "/opt/twinkle/bin/python"


def _dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_image_installs_with_the_same_script(fake_python):
    steps = _dockerfile()
    runs = [rest for word, rest in steps if word == "RUN" and "scripts/install.sh" in rest]
    assert len(runs) == 2, runs  # the dependencies' layer, then the project's
    where = [rest for _, rest in steps]
    deps_at, project_at, copy_all_at = (where.index(runs[0]), where.index(runs[1]),
                                        steps.index(("COPY", ". .")))
    # torch and the dependencies install before the source is copied in (a source change
    # keeps that layer), from only what the script reads.
    assert deps_at < copy_all_at < project_at
    copied = [rest.split()[0] for word, rest in steps[:deps_at] if word == "COPY"]
    assert sorted(copied) == ["pyproject.toml", "scripts/install.sh"]
    deps = _pip_install(fake_python(runs[0]))
    assert deps[deps.index("torch==2.13.0") + 1:][0].startswith("transformers")
    assert not any(a in (".", "-e") or a.startswith(".[") for a in deps), deps
    assert any(a.startswith("megatron-core") for a in deps), "--tp > 1 needs megatron-core"
    args = _pip_install(fake_python(runs[1]))
    assert "torch==2.13.0" in args and args[-1] == ".[megatron]" and "-e" not in args
    # No configuration is baked in: it comes from a mount (or flags).
    assert not any("twinkled.toml" in rest for word, rest in steps if word in ("RUN", "COPY"))


def test_compose_file_has_a_data_volume_a_gpu_reservation_and_the_image():
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((ROOT / "ops" / "compose.yaml").read_text())
    service = compose["services"]["twinkled"]
    assert (ROOT / "ops" / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    mounts = [v.removesuffix(":ro").rsplit(":", 1) for v in service["volumes"]]
    volumes = {inside: source for source, inside in mounts}
    assert volumes["/var/lib/twinkle"] in compose["volumes"], "the data in a named volume"
    assert "/etc/twinkle/twinkled.toml" in volumes, "the configuration mounted"
    gpus = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in gpus)
    assert service["ports"] == ["8000:8000"]
    # Time to drain and persist, as the systemd unit gives.
    assert int(service["stop_grace_period"].rstrip("s")) >= int(_unit()["TimeoutStopSec"])


def test_image_entrypoint_healthcheck_and_volume():
    steps = dict((w, r) for w, r in _dockerfile() if w != "RUN")
    assert steps["FROM"] == "${BASE}" and "BASE=python:3.11-slim" in steps["ARG"]
    assert steps["ENTRYPOINT"] == '["twinkled", "serve"]'
    assert steps["CMD"] == '["--config", "/etc/twinkle/twinkled.toml"]'
    assert steps["VOLUME"] == "/var/lib/twinkle" and steps["EXPOSE"] == "8000"
    assert steps["USER"] == "twinkle"
    probe = re.search(r'"-c", "(.*)"\]', steps["HEALTHCHECK"])[1]
    assert "/api/v1/healthz" in probe
    compile(probe, "healthcheck", "exec")


def test_dockerignore_keeps_what_the_build_needs():
    patterns = [p.strip().strip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert ".git" in patterns

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
                   for p in prefixes for pat in patterns)

    needed = ["pyproject.toml", "README.md", "scripts/install.sh", "ops/twinkled.toml",
              "twinkled/server/cli.py", "scheduler/planner.py", "tinker_shim/routes.py",
              "twinkle_sdk/model.py"]
    assert [p for p in needed if ignored(p)] == []
    assert ignored("twinkle.egg-info/PKG-INFO") and ignored(".whl/torch.whl")


# -- the operator guide ------------------------------------------------------------------------


CTL = ["keys create", "keys list", "keys revoke", "tenants list", "tenants set", "runs list",
       "runs show", "runs delete", "checkpoints list", "checkpoints verify",
       "checkpoints delete", "drain", "status"]
METRICS = ["twinkle_tokens_trained_total", "twinkle_tokens_sampled_total",
           "twinkle_step_seconds", "twinkle_queue_wait_seconds", "twinkle_queue_depth",
           "twinkle_adapters_loaded", "twinkle_worker_restarts_total",
           "twinkle_gpu_memory_bytes", "twinkle_requests_total",
           "twinkle_worker_busy_seconds_total", "twinkle_gather_wait_seconds"]


def test_guide_covers_every_ctl_command_and_the_metrics():
    for command in CTL:
        assert f"tctl {command}" in GUIDE, f"docs/operator.md does not show ctl {command}"
    import click

    from twinkled.server.cli import main

    def walk(group, prefix=""):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from walk(cmd, f"{prefix}{name} ")
            else:
                yield prefix + name

    for command in walk(main.commands["ctl"]):  # and whatever the CLI grows
        assert f"tctl {command}" in GUIDE, f"docs/operator.md does not show ctl {command}"
    assert "GET /metrics" in GUIDE
    for name in METRICS:
        assert f"`{name}`" in GUIDE, name
    for needed in ("twinkled config check", "journalctl -u twinkled", "systemctl enable --now",
                   "admin.key", "quarantine", ".backup", "reference.md",
                   "log_format", "--log-format json", "healthz"):
        assert needed in GUIDE, needed
    assert "scripts/install.sh" in GUIDE and "Dockerfile" in GUIDE


def test_the_default_data_dir_is_state_never_the_working_directory(tmp_path, monkeypatch):
    from twinkled.protocol.config import Config, default_data_dir

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    assert default_data_dir() == tmp_path / "state" / "twinkle"
    assert Config().data_dir == tmp_path / "state" / "twinkle"
    # A data dir an older version made under XDG_DATA_HOME is kept in use ...
    (tmp_path / "data" / "twinkle").mkdir(parents=True)
    (tmp_path / "data" / "twinkle" / "twinkle.db").write_bytes(b"")
    assert default_data_dir() == tmp_path / "data" / "twinkle"
    # ... until the new one exists.
    (tmp_path / "state" / "twinkle").mkdir(parents=True)
    assert default_data_dir() == tmp_path / "state" / "twinkle"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_data_dir() == Path.home() / ".local" / "state" / "twinkle"

