"""Cluster deployment files: ops/k8s (LeaderWorkerSet) and ops/slurm (sbatch).

Offline and fast: kubectl and Slurm are not installed here, so every core object of the
manifests (and the leader's and workers' pod templates inside the LeaderWorkerSet, a CRD
whose schema is not Kubernetes') is validated against Kubernetes' own OpenAPI schema in
strict mode (kubernetes-validate, the schemas it ships), the LeaderWorkerSet's fields and
the references between objects (claims, secret, config) are checked, and the batch script runs with stand-in `scontrol`/`srun` that record what it
asks for; every twinkled command line in either is parsed by the real CLI and every config
they carry passes `check_config`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from twinkled.protocol.config import check_config
from twinkled.server.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "ops" / "k8s" / "twinkled.yaml"
SBATCH = ROOT / "ops" / "slurm" / "twinkled.sbatch"


def _docs() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    for d in docs:  # what every object needs to be accepted at all
        assert {"apiVersion", "kind", "metadata"} <= set(d), d.get("kind")
        assert d["metadata"].get("name"), d["kind"]
        assert "spec" in d or "data" in d, d["kind"]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    return by_kind


def _parses(argv: list[str]) -> None:
    """The real CLI accepts this command line (options, types, required ones)."""
    name, *rest = argv
    cmd = cli.commands[name]
    # under the group's context, as a real command line runs: a context without the
    # group's settings would make click cache `serve`'s help option as `--help` alone
    with cli.make_context("twinkled", [name], resilient_parsing=True) as parent:
        cmd.make_context(name, rest, parent=parent)


def test_manifests_have_the_api_fields_and_their_references_resolve(tmp_path):
    kinds = _docs()
    (lws,) = kinds["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    assert tmpl["size"] >= 2 and lws["spec"]["replicas"] == 1
    claims = {d["metadata"]["name"] for d in kinds["PersistentVolumeClaim"]}
    maps = {d["metadata"]["name"]: d for d in kinds["ConfigMap"]}
    pods = {"leader": tmpl["leaderTemplate"]["spec"], "worker": tmpl["workerTemplate"]["spec"]}
    for role, pod in pods.items():
        (c,) = pod["containers"]
        assert c["image"] and c["resources"]["limits"]["nvidia.com/gpu"] >= 1, role
        volumes = {v["name"]: v for v in pod["volumes"]}
        for m in c["volumeMounts"]:  # every mount has its volume, every claim exists
            v = volumes[m["name"]]
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
            if "configMap" in v:
                assert v["configMap"]["name"] in maps
        secrets = [v["secret"]["secretName"] for v in volumes.values() if "secret" in v]
        assert secrets == ["twinkle-join"], role  # the join token comes from a Secret
    leader = pods["leader"]["containers"][0]
    assert "healthz" in str(leader["readinessProbe"]) and "'ok'" in str(leader["readinessProbe"])
    assert any(m["mountPath"] == "/var/lib/twinkle" for m in leader["volumeMounts"])
    # The config the leader mounts checks clean and asks for the worker pods' GPUs.
    toml = tmp_path / "twinkled.toml"
    toml.write_text(maps["twinkled-config"]["data"]["twinkled.toml"])
    assert check_config(toml) == []
    text = toml.read_text()
    gpus = pods["worker"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert f"remote_ranks = {gpus * (tmpl['size'] - 1)}" in text
    # The worker's command line is one the CLI takes, joining the leader's join port.
    (script,) = pods["worker"]["containers"][0]["args"]
    argv = shlex.split(script.replace("${LWS_LEADER_ADDRESS}", "head").replace('"$(hostname)"', "w"))
    assert argv[:2] == ["exec", "twinkled"] and "tcp://head:7070" in argv
    _parses(argv[2:])
    _parses(["serve", *(str(toml) if a.endswith(".toml") else a for a in leader["args"])])
    (svc,) = kinds["Service"]
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_manifests_pass_kubernetes_schema_validation():
    """What `kubectl apply --dry-run=client` would check, offline: each object against the
    schema of its kind and apiVersion, unknown fields refused (strict)."""
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    kinds = _docs()
    validated = []
    for kind, docs in kinds.items():
        if kind == "LeaderWorkerSet":
            continue
        for d in docs:
            kv.validate(d, version, strict=True)  # raises, naming the field, if invalid
            validated.append(kind)
    assert {"ConfigMap", "PersistentVolumeClaim", "Service"} <= set(validated)
    (lws,) = kinds["LeaderWorkerSet"]
    for role in ("leaderTemplate", "workerTemplate"):  # PodTemplateSpecs: a Pod each
        template = lws["spec"]["leaderWorkerTemplate"][role]
        pod = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"],
               "metadata": {**template.get("metadata", {}), "name": role.lower()}}
        kv.validate(pod, version, strict=True)
    broken = {**kinds["Service"][0], "spec": {**kinds["Service"][0]["spec"], "prots": []}}
    with pytest.raises(kv.ValidationError):  # the check bites: a misspelt field is refused
        kv.validate(broken, version, strict=True)


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_passes_bash_n_and_starts_a_head_and_joining_workers(tmp_path):
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed (the script makes the join token with it)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.log"
    _stub(bin_dir, "scontrol", 'printf "node1\\nnode2\\nnode3\\n"\n')
    # The head's srun lasts until the workers' has started (the script ends them with it).
    _stub(bin_dir, "srun", f'printf "%s\\n" "$*" >> {log}\n'
          f'[[ "$*" == *" serve "* ]] && for _ in $(seq 100); do grep -q " worker " {log} && break; sleep 0.1; done\n'
          'exit 0\n')
    data = tmp_path / "data"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-3]",
               SLURM_JOB_ID="42", SLURM_GPUS_ON_NODE="4", TWINKLE="twinkled",
               TWINKLE_MODEL="/models/m", TWINKLE_DATA=str(data))
    subprocess.run(["bash", str(SBATCH)], env=env, check=True, timeout=30)
    lines = sorted(log.read_text().splitlines())
    assert len(lines) == 2, lines
    by_cmd = {shlex.split(ln)[shlex.split(ln).index("twinkled") + 1]: shlex.split(ln) for ln in lines}
    serve, worker = by_cmd["serve"], by_cmd["worker"]
    assert "--nodelist=node1" in serve and "--exclude=node1" in worker and "--nodes=2" in worker
    _parses(serve[serve.index("twinkled") + 1:])
    _parses(worker[worker.index("twinkled") + 1:])
    assert worker[worker.index("--join") + 1] == "tcp://node1:7070"
    assert worker[worker.index("--devices") + 1] == "cuda:0,cuda:1,cuda:2,cuda:3"
    config = data / "twinkled-42.toml"
    assert check_config(config) == []
    assert 'join_listen = "tcp://node1:7070"' in config.read_text()
    assert "remote_ranks = 8" in config.read_text()  # two worker nodes x 4 GPUs
    assert stat.S_IMODE((data / "join.key").stat().st_mode) == 0o600
