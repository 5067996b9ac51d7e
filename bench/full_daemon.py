"""bench_full.py --daemon: the full-parameter run through a real `twinkled serve` and the
unmodified tinker client (issue 37), beside the plain FSDP2 loop of the same invocation.

The daemon is one lane of the R cards (`--devices cuda:0,...`; on a CPU box R gloo
workers) with `full_run_only_lane = true`: the operator's choice that lets a full run take
a one-lane daemon's lane while no LoRA run is there (core/exclusive.py), its fp32 masters
and moments split over the R ranks (ZeRO-1). Default settings otherwise: the sizing
estimate counts the KV pool the run's lane will hold (made at the first sample, at most
4 GiB while a full run lives: sizing.FULL_RUN_KV_BYTES), not the 30% of each card LoRA
tenants' sampling gets, so an 8B run on 2 x H200 (8 bytes a parameter: 61.0 GiB a card)
is admitted without `sample_kv_mb`.

Each timed step is one `forward_backward` of R x `--batch` rows of `--seq` tokens (the lane
spreads the rows over its ranks: `--batch` a rank, as the plain loop) with its `optim_step`
sent right behind it, as a training loop does; tok/s is the median step's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_engine import Row

START_S = 420  # the daemon loading an 8B on its cards (~1-2 min)
STEP_S = 300  # one step's result (the first one compiles and warms the allocator)


def _log_tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _start(model_dir: Path, work: Path, device: str, ranks: int) -> tuple:
    """`twinkled serve`, one lane of `ranks` workers that a full run may take; returns
    (process, url, log path) once /healthz says "ok", or exits with the log's tail."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from daemon import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cuda = device.startswith("cuda")
    layout = (["--devices", ",".join(f"cuda:{i}" for i in range(ranks))] if cuda
              else ["--device", "cpu", "--workers", str(ranks)])
    log = work / "twinkled.log"
    config = work / "twinkled.toml"
    config.write_text("full_run_only_lane = true\n")
    cmd = [sys.executable, "-m", "twinkled", "serve", "--model", str(model_dir),
           "--data-dir", str(work / "data"), "--port", str(port), "--lanes", "1", *layout,
           "--config", str(config),
           "--dtype", "bfloat16" if cuda else "float32"]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, HF_HUB_OFFLINE="1"))
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"twinkled exited ({proc.returncode}) while starting:\n"
                             f"{_log_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=5) as r:
                health = json.loads(r.read()).get("status")
        except urllib.error.HTTPError as e:  # 503 while loading, with the state
            try:
                health = json.loads(e.read()).get("status")
            except ValueError:
                health = None
        except OSError:
            health = None
        if health == "ok":
            return proc, url, log
        if health == "failed":  # the model did not load: it never will
            _stop(proc)
            raise SystemExit(f"twinkled failed to load the model:\n{_log_tail(log)}")
        time.sleep(1)
    _stop(proc)
    raise SystemExit(f"twinkled not up after {START_S} s:\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 60 s: the cards must be free for the plain loop."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _key(data: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data),
                          "--create", "keys", "create", "--tenant", "full"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    return out.strip().splitlines()[-1]


def _peak_gib(data: Path) -> float | None:
    """The largest peak GPU memory of the daemon's workers, from `twinkled ctl status
    --json`."""
    try:
        out = subprocess.run([sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data),
                              "status", "--json"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        peaks = [w.get("peak_memory_bytes", 0) for w in json.loads(out).get("workers", [])]
    except (subprocess.SubprocessError, ValueError, AttributeError):
        return None
    return max(peaks) / 2**30 if peaks and max(peaks) else None


def _train(url: str, key: str, name: str, vocab: int, rows: int, seq: int, warmup: int,
           reps: int) -> float:
    """The median seconds of `reps` steps (after `warmup`) of a rank-0 run."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    rng = random.Random(0)
    data = []
    for _ in range(rows):
        ids = [rng.randrange(vocab) for _ in range(seq + 1)]
        data.append(tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                       loss_fn_inputs={"target_tokens": ids[1:]}))
    adam = tinker.types.AdamParams(learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8)
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=name, rank=0).result(timeout=STEP_S)
    times = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)  # sent before the result, as real loops do
        fb.result(timeout=STEP_S)
        opt.result(timeout=STEP_S)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def layout_note(device: str, ranks: int) -> str:
    """What the section says of the daemon's layout."""
    ranks_are = f"{ranks} GPU(s)" if device.startswith("cuda") else f"{ranks} gloo rank(s)"
    return (f"The daemon: one lane of {ranks_are}, `full_run_only_lane = true` (the run takes "
            "the lane; ZeRO-1: fp32 masters and moments split over its ranks), default KV "
            "settings (the estimate counts the 4 GiB pool a full run's lane samples with); "
            "each step one forward_backward + optim_step from the unmodified tinker client.")


def daemon_row(model_dir: Path, device: str, ranks: int, batch: int, seq: int, warmup: int,
               reps: int) -> Row:
    """The full run through the daemon: one row of the bench's table."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="bench_full_daemon_") as tmp:
        work = Path(tmp)
        key = _key(work / "data")
        proc, url, log = _start(model_dir, work, device, ranks)
        try:
            seconds = _train(url, key, model_dir.name, vocab, ranks * batch, seq, warmup, reps)
            peak = _peak_gib(work / "data") if device.startswith("cuda") else None
        except Exception as e:
            print(f"the daemon run failed: {e!r}\n--- twinkled log tail ---\n{_log_tail(log)}",
                  file=sys.stderr)
            raise
        finally:
            _stop(proc)
    return Row(f"twinkle full run through twinkled ({ranks} GPU lane, tinker client)"
               if device.startswith("cuda") else
               f"twinkle full run through twinkled ({ranks} gloo ranks, tinker client)",
               ranks * batch * seq, seconds, peak)
