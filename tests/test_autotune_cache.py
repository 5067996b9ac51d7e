"""The engine keeps Triton's autotuning picks on disk (a restarted worker does not time every
config of fla-core's kernels again, ~40 s a set of head sizes on an H200), unless the
operator chose otherwise."""

from __future__ import annotations

import os
import subprocess
import sys


def _setting(env: dict) -> str:
    code = ("import twinkled.engine, triton.knobs as k, os; "
            "print(os.environ['TRITON_CACHE_AUTOTUNING'], k.autotuning.cache)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout.split()


def test_engine_turns_on_triton_autotune_cache():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_AUTOTUNING"}
    assert _setting(env) == ["1", "True"]


def test_operator_setting_wins():
    assert _setting(dict(os.environ, TRITON_CACHE_AUTOTUNING="0")) == ["0", "False"]
