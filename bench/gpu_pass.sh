#!/usr/bin/env bash
# The GPU measurements the open issues wait for, batched so that one device call on a
# 2-GPU machine runs a group of them (a call is limited to 10 minutes):
#
#   bash bench/gpu_pass.sh workers sampling   # issue 14 (flat banks), issue 16 (sampler)
#   bash bench/gpu_pass.sh tp                 # issue 15: 8B at tp 1 and 2 (32B: tp32)
#   bash bench/gpu_pass.sh moe                # issue 17: Qwen3-30B-A3B shape, 1 GPU and --ep 2
#
# Each bench writes its section under $OUT (the device's returned folder) or bench/results/.
set -uo pipefail
cd "$(dirname "$0")"
out="${OUT:-results}"
mkdir -p "$out"
printf 'persist_every = 0\n' > /tmp/gpu_pass_p0.toml
for what in "$@"; do
    echo "== $what"
    case "$what" in
        workers) python bench_workers.py --devices cuda:0,cuda:1 --shape qwen2.5-0.5b \
                     --config /tmp/gpu_pass_p0.toml --trace --write "$out/workers.md" ;;
        sampling) python bench_sampling.py --device cuda --shape qwen2.5-0.5b \
                     --write "$out/sampling.md" ;;
        tp) python bench_tp.py --shape qwen3-8b --tp 1,2 ;;
        tp32) python bench_tp.py --shape qwen3-32b --tp 2 ;;
        moe) python bench_moe.py --devices cuda:0,cuda:1 --layers 12 --write "$out/moe.md" ;;
        *) echo "unknown: $what (workers, sampling, tp, tp32, moe)"; exit 2 ;;
    esac
done
