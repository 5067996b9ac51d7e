"""Every tinker SDK from 0.16.1 to 0.38.0, unmodified, against one real `twinkled serve`.

Each version (tests/tinker_sdks.py: which, and where `make install` puts them) runs one
round trip in its own process, with only its `tinker` package ahead of the project's
environment: train a step (forward_backward with cross_entropy, optim_step, forward), save
weights for a sampler and sample from them, save the state and load it into a new model.
Up to 0.24 that is the JSON wire (tinker_shim/json_wire.py); from 0.25 the protobuf one.
A version that is not installed (offline) is skipped, saying how to install it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker_sdks

HERE = Path(__file__).parent


@pytest.mark.parametrize("version", tinker_sdks.VERSIONS)
def test_an_unmodified_sdk_trains_samples_saves_and_loads(version, daemon, tiny_dir):
    if not tinker_sdks.installed(version):
        pytest.skip(f"tinker=={version} is not installed in {tinker_sdks.target(version)}: "
                    "`make install` (or `python tests/tinker_sdks.py install`) puts it there")
    env = dict(os.environ, PYTHONPATH=str(tinker_sdks.target(version)))
    proc = subprocess.run([sys.executable, str(HERE / "tinker_sdks.py"), "run", daemon.url,
                           daemon.keys["alice"], tiny_dir.name],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["version"] == version  # that SDK ran, not the project's own
    assert got["logprobs"] == 8  # one per target token, read back from the result
    assert got["loss_after"] < got["loss_before"]  # the step trained the adapter
    # The state saved and loaded into a new model is the trained one, not a fresh adapter.
    assert got["loss_loaded"] == pytest.approx(got["loss_after"], rel=1e-5)
    assert len(got["sampled"]) == 4 and len(got["sampled_logprobs"]) == 4
    assert all(lp <= 0 for lp in got["sampled_logprobs"])
    assert got["sampler_path"].endswith("/sampler_weights/rt-sampler")
    assert got["state_path"].endswith("/weights/rt-state")
