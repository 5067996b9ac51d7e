"""The tinker SDK versions the Tinker face is tested with, beside the one installed.

    python tests/tinker_sdks.py install           # what `make install` runs (needs the index)
    python tests/tinker_sdks.py run URL KEY MODEL  # one round trip with the `tinker` on the path

Each version lives in its own directory `<cache>/tinker-<version>` (``pip install --no-deps
--target``), so that a client run with ``PYTHONPATH=<that directory>`` differs from the
project's environment in the `tinker` package only (every version here imports with its
httpx, pydantic and the rest). The cache is outside the checkout: ``$TWINKLE_TINKER_SDKS``,
else ``$XDG_CACHE_HOME/twinkle/tinker-sdks`` (``~/.cache/...``). Offline, installing fails
and says so; tests/test_tinker_versions.py then skips the versions that are missing.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

# 0.16.1: the seed system's users'; 0.24.1: the last JSON forward_backward; 0.25.0: the
# first protobuf one; then one every few releases up to the project's own (0.38.0).
VERSIONS = ["0.16.1", "0.24.1", "0.25.0", "0.30.4", "0.33.1", "0.36.0", "0.38.0"]


def cache_dir() -> Path:
    if os.environ.get("TWINKLE_TINKER_SDKS"):
        return Path(os.environ["TWINKLE_TINKER_SDKS"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "twinkle" / "tinker-sdks"


def target(version: str) -> Path:
    """Where `version` is installed: put it first on PYTHONPATH to run it."""
    return cache_dir() / f"tinker-{version}"


def installed(version: str) -> bool:
    return (target(version) / f"tinker-{version}.dist-info").is_dir()


def _install_one(version: str) -> bool:
    print(f"tinker_sdks: tinker=={version} into {target(version)}", flush=True)
    cache_dir().mkdir(parents=True, exist_ok=True)
    # Into a fresh directory, moved in place when complete: no half-installed version.
    tmp = Path(tempfile.mkdtemp(prefix=f".tinker-{version}-", dir=cache_dir()))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--disable-pip-version-check", "--target", str(tmp),
                           f"tinker=={version}"]).returncode == 0
    if done:
        shutil.rmtree(target(version), ignore_errors=True)
        tmp.rename(target(version))
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return done


def install() -> int:
    """Install the missing versions; a failure (offline) is reported, not fatal. The first
    one alone: if it fails the index is out of reach and the others are not tried (each try
    is a pip start, seconds of CPU in every `make install`); then the rest side by side,
    since each is mostly a download."""
    missing = [v for v in VERSIONS if not installed(v)]
    failed = []
    if missing and not _install_one(missing[0]):
        failed = missing
    elif missing[1:]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(_install_one, missing[1:]))
        failed = [v for v, ok in zip(missing[1:], done, strict=True) if not ok]
    if failed:
        print(f"tinker_sdks: could not install tinker {', '.join(failed)} (offline?); "
              "tests/test_tinker_versions.py skips them", flush=True)
    return 0


def round_trip(url: str, key: str, model: str) -> dict:
    """What a user's script does with any of these SDKs, unmodified: train a step, sample
    from the saved weights, download them as an archive (SDK <= 0.35), save the state and
    train on from it. Prints nothing on the way; the caller checks what it returns."""
    # The SDK's types import torch when they can (seconds of start-up each version); the
    # round trip passes lists, so it runs without.
    sys.modules.setdefault("torch", None)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    t = 120  # every wait has a timeout: a broken server fails the test, not hangs it

    def ready(client):  # 0.38 hands back a future of the client (usable as one, with a warning)
        return client.result(timeout=t) if hasattr(client, "result") else client

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = ready(sc.create_lora_training_client(base_model=model, rank=4))
    tokens = [5, 17, 42, 99, 7, 23, 64, 11, 3]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [1.0] * (len(tokens) - 1)})
    fb = tc.forward_backward([datum], "cross_entropy").result(timeout=t)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=t)
    after = tc.forward([datum], "cross_entropy").result(timeout=t)
    sampler_path = tc.save_weights_for_sampler("rt-sampler").result(timeout=t).path
    sampler = ready(sc.create_sampling_client(model_path=sampler_path))
    sample = sampler.sample(types.ModelInput.from_ints(tokens[:3]), 1,
                            types.SamplingParams(max_tokens=4, temperature=0.0)
                            ).result(timeout=t).sequences[0]
    archive_url = archive = None
    rest = sc.create_rest_client()
    if hasattr(rest, "get_checkpoint_archive_url_from_tinker_path"):  # SDK <= 0.35
        archive_url = rest.get_checkpoint_archive_url_from_tinker_path(sampler_path
                                                                       ).result(timeout=t).url
        with urllib.request.urlopen(archive_url, timeout=t) as r:  # no key: the URL is signed
            archive = tarfile.open(fileobj=io.BytesIO(r.read())).getnames()
    state_path = tc.save_state("rt-state").result(timeout=t).path
    loaded = ready(sc.create_training_client_from_state(state_path))
    reloaded = loaded.forward([datum], "cross_entropy").result(timeout=t)
    return {"version": tinker.__version__,
            "loss_before": fb.metrics["loss:sum"], "loss_after": after.metrics["loss:sum"],
            "loss_loaded": reloaded.metrics["loss:sum"],
            "logprobs": len(fb.loss_fn_outputs[0]["logprobs"].tolist()),
            "sampled": list(sample.tokens), "sampled_logprobs": sample.logprobs,
            "sampler_path": sampler_path, "state_path": state_path,
            "archive_url": archive_url, "archive": archive}


if __name__ == "__main__":
    if sys.argv[1:2] == ["install"]:
        sys.exit(install())
    if sys.argv[1:2] == ["run"] and len(sys.argv) == 5:
        print(json.dumps(round_trip(*sys.argv[2:])))
        sys.exit(0)
    sys.exit(__doc__)
