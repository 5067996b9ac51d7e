#!/usr/bin/env bash
# The GPU measurements the open issues wait for, batched so that a few device calls on one
# 4-GPU machine run them all (a call is limited to 10 minutes; the machine stays warm
# between calls, so files written by one call are there for the next):
#
#   bash bench/gpu_pass.sh workers4 lanes4         # issue 14: 1/2/4 workers, as one data-parallel
#                                                  #   group and as lanes (twinkled --lanes)
#   bash bench/gpu_pass.sh workers4 prewrite moe   # issue 14 (1/2/4 workers), issue 17 (MoE)
#   bash bench/gpu_pass.sh lanes8b                 # issue 14: the 8B on 1 and 4 lanes, 8 tenants a GPU
#   bash bench/gpu_pass.sh workers8b lanes dpnuma  # issue 14: 1/2/4 workers on the 8B shape;
#                                                  #   one daemon per GPU (the bound of lanes);
#                                                  #   the engine's 4 ranks with NUMA binding
#   bash bench/gpu_pass.sh tp32 tp                 # issue 15: 32B at tp 2 (daemon traced,
#                                                  #   peft, engine alone); 8B engine tp 1, 2
#   bash bench/gpu_pass.sh tp70                    # issue 15: a 70B shape at tp 4 via the daemon
#   bash bench/gpu_pass.sh sampling slices         # issue 16 (one GPU: $SAMPLING_GPU, default 0)
#   bash bench/gpu_pass.sh gap                     # issue 31: sampler vs trainer logprob gap
#   bash bench/gpu_pass.sh gpucheck grouped        # issue 31: the grouped LoRA launches, checked
#                                                  #   compiled, then timed against one a module
#   bash bench/gpu_pass.sh loradec prep            # issue 31: the LoRA row kernels' variants; the
#                                                  #   q/k prep kernel on and off, both shapes
#   bash bench/gpu_pass.sh direct                  # issue 31: the paged decode writing a lone
#                                                  #   part's output itself, checked, then timed
#   bash bench/gpu_pass.sh done31                  # issue 31's done-when: old/new/padded paths,
#                                                  #   both shapes and workloads, one call
#   bash bench/gpu_pass.sh gpucheck fusedpick      # issue 31: the fused token choice, checked
#                                                  #   compiled, then timed against choose.py
#   bash bench/gpu_pass.sh gappaths prof8b         # issue 31: the gap path by path; issue 32: the
#                                                  #   8B training step profiled (1 and 8 adapters)
#   bash bench/gpu_pass.sh qwen35                  # issue 34: Qwen3.5 GPU tests, 9B figures
#   bash bench/gpu_pass.sh q35prof                 # issue 34: where the 9B's training step goes
#                                                  #   (through the daemon 0.25x peft, session 9)
#   bash bench/gpu_pass.sh rlstep                  # issue 31: the cookbook RL step, 8B
#   bash bench/gpu_pass.sh tenants05; ... tenants8b  # issue 33: 1,000 / 200 runs (a call each)
#   bash bench/gpu_pass.sh tenants05h sampdaemon     # issue 33 on one H200; issue 31's daemon sampling
#   bash bench/gpu_pass.sh tiercheck park tenants05  # issue 33: the host tier's GPU tests, a park's
#                                                  #   and an unpark's cost, 1,000 runs (~8 min)
#   bash bench/gpu_pass.sh vl                      # issue 35: Qwen2.5-VL-7B, Qwen3-VL-8B through the daemon
#   bash bench/gpu_pass.sh arch archsamp           # issue 34: gpt-oss-20b, DeepSeek-V3 (reduced) shapes
#   bash bench/gpu_pass.sh journal                 # the journal's fsyncs on the machine's disk
#   bash bench/gpu_pass.sh fulld longd             # issues 37, 38 through the daemon (2 GPUs, a call each)
#   bash bench/gpu_pass.sh long4 longd4            # issue 38 on 4 GPUs: cp 4 rows; a small tenant
#                                                  #   beside a 128K row on two lanes of cp 2
#   bash bench/gpu_pass.sh tpsamp; ... gpttp2      # tp sampling paths; gpt-oss --tp 2 (2 GPUs, a call each)
#   bash bench/gpu_pass.sh gpucheck                # the GPU-only tests of the fast paths (fused
#                                                  #   layer, overlapped decode, direct LoRA,
#                                                  #   cascade, flash varlen, q/k prep): run before
#                                                  #   timing them
#
# `prewrite` starts writing the 32B and 70B random checkpoints in the background (its own
# process session, on GPU 3), so the tp32 and tp70 steps, which wait for them, need not.
# Put it after `workers4`, never before: writing 137 GB beside the 4-worker run (GPU 3, the
# disk, the host) spoiled that run's figures once.
# The 70B one (137 GB) waits for the disk to have room beside the 32B one (65 GB).
# Each bench writes its section under $OUT (the device's returned folder) or bench/results/.
set -uo pipefail
cd "$(dirname "$0")"
# The device tool returns at most 8 files from $OUT: the logs and sections are written to a
# folder of their own and come back as one archive, $OUT/gpu_pass.tgz, packed again after
# each part (a call cut off at its limit still returns the parts before).
out="${OUT:+/tmp/gpu_pass_out}"
out="${out:-results}"
mkdir -p "$out"
# GPU_PASS_GPU=N: this pass on GPU N alone, its archive gpu_pass_N.tgz (two passes of one
# call side by side on a 2-GPU machine: `GPU_PASS_GPU=1 bash gpu_pass.sh done31 &` beside
# `GPU_PASS_GPU=0 bash gpu_pass.sh tenants05`)
[ -n "${GPU_PASS_GPU:-}" ] && export CUDA_VISIBLE_DEVICES="$GPU_PASS_GPU"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_pass${GPU_PASS_GPU:+_$GPU_PASS_GPU}.tgz" -C "$out" . 2>/dev/null; return 0; }
printf 'persist_every = 0\n' > /tmp/gpu_pass_p0.toml
printf 'token_budget = 4096\nhost_adapter_memory_gb = 64\n' > /tmp/gpu_pass_tb4k.toml
ckpt="${GPU_PASS_CKPT:-/tmp/gpu_pass}"
mem_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)  # (GiB, for host shares)
py="$(command -v python3 || command -v python)"

wait_for() {  # a checkpoint `prewrite` is writing
    while [ ! -e "$1/.done" ]; do
        if [ -e "$ckpt/prewrite.failed" ]; then echo "prewrite failed:"; tail -5 "$ckpt/prewrite.log"; return 1; fi
        sleep 5
    done
}

for what in "$@"; do
    echo "== $what $(date +%T)"
    case "$what" in
        workers) "$py" bench_workers.py --devices cuda:0,cuda:1 --shape qwen2.5-0.5b \
                     --config /tmp/gpu_pass_p0.toml --trace --write "$out/workers.md" ;;
        workers4) "$py" bench_workers.py --devices cuda:0-3 --sizes 1,2,4 --shape qwen2.5-0.5b \
                      --config /tmp/gpu_pass_p0.toml --trace --write "$out/workers.md" ;;
        # the same tenants on lanes: one worker group per GPU, each tenant's adapter on one
        # (1 lane again at the end, 60 steps: the 1-GPU figure moves from run to run)
        lanes4) "$py" bench_workers.py --devices cuda:0-3 --sizes 1,2,4,1 --shape qwen2.5-0.5b \
                    --steps 60 --lanes --config /tmp/gpu_pass_p0.toml --trace --write "$out/workers.md" ;;
        # the regime where the GPU, not the host, bounds a step: does the daemon scale there?
        # 4 tenants per worker: every rank holds every adapter, and 32 rank-32 adapters of
        # the 8B (1.46 GiB each) do not fit an H100 beside the model (18 do)
        # the 8B on lanes: each GPU holds only its own lane's adapters, so 8 tenants a GPU fit
        lanes8b) "$py" bench_workers.py --devices cuda:0-3 --sizes 1,4 --shape qwen3-8b \
                     --tenants 8 --steps 30 --lanes --config /tmp/gpu_pass_p0.toml --trace \
                     --write "$out/workers.md" ;;
        workers8b) "$py" bench_workers.py --devices cuda:0-3 --sizes 1,2,4 --shape qwen3-8b \
                       --tenants 4 --steps 10 --config /tmp/gpu_pass_p0.toml --trace --write "$out/workers.md" ;;
        # the engine alone over 4 ranks, 32 adapters, with and without NUMA binding: do the
        # ranks' forward_backward times (143-193 ms on the same rows, last pass) converge?
        dpnuma) for bind in "" "--numa-binding node"; do
                    echo "-- torchrun $bind"
                    torchrun --nproc_per_node 4 $bind profile_dp.py --adapters 32 2>&1 | grep "^rank"
                done ;;
        # one daemon per GPU, 8 tenants each, all at once: what placing each tenant on one
        # GPU would give, against workers4's data-parallel group
        lanes) "$py" bench_lanes.py --devices cuda:0-3 --shape qwen2.5-0.5b \
                   --config /tmp/gpu_pass_p0.toml --write "$out/lanes.md" ;;
        prewrite) mkdir -p "$ckpt"
                  CUDA_VISIBLE_DEVICES=3 setsid bash -c "
                      $py bench_tp.py --shape qwen3-32b --prepare-only --model-dir $ckpt/qwen3-32b \
                        && touch $ckpt/qwen3-32b/.done \
                      && while [ -e $ckpt/qwen3-32b ] \
                               && [ \$(df --output=avail -B1G $ckpt | tail -1) -lt 160 ]; do sleep 5; done \
                      && $py bench_tp.py --shape llama3-70b --prepare-only --model-dir $ckpt/llama3-70b \
                        && touch $ckpt/llama3-70b/.done || touch $ckpt/prewrite.failed
                  " > "$ckpt/prewrite.log" 2>&1 < /dev/null & ;;
        sampling) CUDA_VISIBLE_DEVICES="${SAMPLING_GPU:-0}" "$py" bench_sampling.py --device cuda \
                      --shape qwen2.5-0.5b --write "$out/sampling.md" ;;
        # issue 31: the grouped LoRA launches against one pair a module, both workloads, both
        # shapes, the same weights (about 4 minutes)
        grouped) for s in qwen3-8b qwen2.5-0.5b; do "$py" bench_sampling.py --device cuda \
                     --shape "$s" --paths new,ungrouped --no-baseline --repeats 2 \
                     --write "$out/grouped_$s.md" > "$out/grouped_$s.log" 2>&1
                     grep -a "^|" "$out/grouped_$s.log"; done ;;
        # issue 31's done-when in one call: the old and new decode paths and the padded sampler
        # they replaced, on the same weights, both workloads, both shapes (bench_sampling's
        # defaults on a GPU; the old path is slow: ~10 minutes, so a call of its own)
        # (DONE31_SHAPES, DONE31_TIMEOUT: the 8B alone in a call of its own, with the time
        # its old path needs: it did not finish in 290 s beside the 0.5B, sessions 21-22)
        done31) for s in ${DONE31_SHAPES:-qwen3-8b qwen2.5-0.5b}; do timeout "${DONE31_TIMEOUT:-290}" "$py" bench_sampling.py --device cuda \
                    --shape "$s" --repeats 1 --write "$out/done31_$s.md" > "$out/done31_$s.log" 2>&1
                    grep -a "^|" "$out/done31_$s.log"; done ;;
        # the LoRA row kernels (kernels/lora_decode.py): checked in a CUDA graph against the
        # masked stack, then their knobs timed on one decode step's LoRA work (~1 minute)
        loradec) "$py" bench_lora_decode.py --check --adapters 8,64 > "$out/loradec.log" 2>&1
                 grep -a "^{'path" "$out/loradec.log" ;;
        # a decode layer's q/k norms, rotation and KV store in one kernel (kernels/qk_prep.py,
        # the `prep` lever) against the liger kernels and two stores, same call (~5 minutes)
        prep) for s in qwen3-8b qwen2.5-0.5b; do for f in all norm,rope,silu,gemm; do
                  "$py" bench_sampling.py --device cuda --shape "$s" --paths new --no-baseline \
                      --repeats 2 --fused "$f" --write "$out/prep_${s}_$f.md" \
                      > "$out/prep_${s}_$f.log" 2>&1
                  grep -a "^| [fw]" "$out/prep_${s}_$f.log"; done; done ;;
        # paged_decode.DIRECT (off until this has run): its tests compiled on the card, then
        # the 8B with it on and off, same call (~4 minutes); turn it on if they pass and pay
        direct) (cd .. && TRITON_INTERPRET=0 TWINKLE_TEST_DEVICE=cuda "$py" -c "
import sys, torch, pytest, twinkled.engine.kernels.paged_decode as pd
pd.DIRECT = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_engine_running.py',
                      'tests/test_qk_prep.py']))") 2>&1 | tail -5 | tee "$out/direct_check.txt"
                for d in on off; do "$py" bench_sampling.py --device cuda --shape qwen3-8b \
                    --paths new --no-baseline --repeats 2 --direct "$d" \
                    --write "$out/direct_$d.md" > "$out/direct_$d.log" 2>&1
                    grep -a "^| [fw]" "$out/direct_$d.log"; done ;;
        # the fused token choice (kernels/sample_rows.py, choose.FUSED) against choose.py's
        # reference, same call; run `gpucheck` first (its compiled results)
        fusedpick) for s in qwen2.5-0.5b qwen3-8b; do "$py" bench_sampling.py --device cuda \
                       --shape "$s" --paths new,unfused --no-baseline --repeats 2 \
                       --write "$out/fusedpick_$s.md" > "$out/fusedpick_$s.log" 2>&1
                       grep -a "^|" "$out/fusedpick_$s.log"; done ;;
        slices) CUDA_VISIBLE_DEVICES="${SAMPLING_GPU:-0}" "$py" bench_slices.py \
                    --shape qwen2.5-0.5b --write "$out/slices.md" ;;
        # every fast path's GPU-only checks against its reference (compiled Triton, not the
        # interpreter the CPU suite runs; flash varlen's shared-prefix call, off by default)
        gpucheck) (cd .. && TRITON_INTERPRET=0 TWINKLE_TEST_DEVICE=cuda "$py" -m pytest -q \
                      -p no:cacheprovider tests/test_fused_layer.py tests/test_engine_overlap.py \
                      tests/test_lone_lora.py tests/test_engine_kernels.py \
                      tests/test_flash_varlen.py tests/test_shared_prefix.py \
                      tests/test_engine_packed.py tests/test_logprob_gap.py tests/test_qk_prep.py \
                      "tests/test_lora_kernels.py::test_modules_sharing_an_input_in_one_launch_add_the_same_bits" \
                      tests/test_sample_kernel.py tests/test_bank_growth.py tests/test_host_memory.py) \
                      2>&1 | tail -40 | tee "$out/gpucheck.txt"
                  (cd .. && TRITON_INTERPRET=0 TWINKLE_TEST_DEVICE=cuda "$py" -c "
import sys, pytest, twinkled.engine.flash_varlen as f
f.ENABLED = f.SHARED = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_shared_prefix.py',
                      'tests/test_engine_packed.py', '-k', 'gpu']))") 2>&1 | tail -15 \
                      | tee -a "$out/gpucheck.txt" ;;
        # issue 31 item 4: sampler vs trainer logprobs, bf16, both paths, both shapes
        gap) for s in qwen2.5-0.5b qwen3-8b; do CUDA_VISIBLE_DEVICES="${SAMPLING_GPU:-0}" "$py" \
                 bench_gap.py --device cuda --shape "$s" --padded --write "$out/gap-$s.md"; done ;;
        # where the 8B's gap comes from, path by path (session 15: ~3 minutes)
        gappaths) "$py" bench_gap.py --device cuda --shape qwen3-8b --paths --reference \
                      --write "$out/gap_paths.md" > "$out/gap_paths.log" 2>&1; grep -a "^|" "$out/gap_paths.log" ;;
        # issue 32: where the 8B's training step goes (op table; host issuing vs device)
        prof8b) "$py" profile_engine.py --shape qwen3-8b --device cuda --adapters 1 --adapters 8 \
                    --model-dir "$ckpt/q8b" > "$out/prof8b.txt" 2>&1; grep -a "^forward_backward\|^profiled" "$out/prof8b.txt" ;;
        tp) "$py" bench_tp.py --shape qwen3-8b --tp 1,2 | tee -a "$out/tp.md" ;;
        # the daemon with its trace, the engine alone and plain peft, on the same two cards
        tp32) wait_for "$ckpt/qwen3-32b" && "$py" bench_tp.py --shape qwen3-32b --tp 2 --daemon \
                  --trace --peft --model-dir "$ckpt/qwen3-32b" --token-budget 4096 | tee -a "$out/tp.md"
              "$py" bench_tp.py --shape qwen3-32b --tp 2 --model-dir "$ckpt/qwen3-32b" \
                  --token-budget 4096 | tee -a "$out/tp.md"
              rm -rf "$ckpt/qwen3-32b" ;;
        # r=16: at r=32 the sizing estimate for 8 adapters (73 GiB) leaves an H100 no headroom
        tp70) wait_for "$ckpt/llama3-70b" && "$py" bench_tp.py --shape llama3-70b --tp 4 --daemon \
                  --trace --peft --model-dir "$ckpt/llama3-70b" --token-budget 4096 --lora-rank 16 \
                  | tee -a "$out/tp.md" ;;
        moe) "$py" bench_moe.py --devices cuda:0,cuda:1 --layers 12 --write "$out/moe.md" ;;
        # issue 34: the Qwen3.5 family's CUDA paths (fla-core) against the torch rule, then
        # the 9B shape's figures; logs go to files under $out whole (a timeout keeps them)
        # (one process a test: a kernel's illegal address poisons the process's CUDA context,
        # and every later test of it failed so in session 11; the first fresh machine's run
        # autotunes fla's kernels for minutes)
        qwen35) for t in $(cd .. && TWINKLE_TEST_DEVICE=cuda "$py" -m pytest -q --collect-only \
                           -p no:cacheprovider tests/test_qwen35_gpu.py tests/test_qwen35_moe_gpu.py \
                           | grep "::"); do
                    echo "-- $t"; (cd .. && TRITON_INTERPRET=0 TWINKLE_TEST_DEVICE=cuda timeout 300 \
                        "$py" -m pytest -q -p no:cacheprovider --tb=short "$t") \
                        > "$out/qwen35_gpu.txt" 2>&1; grep -a "passed\|failed\|^E " "$out/qwen35_gpu.txt" | head -8
                done
                "$py" bench_engine.py --shape qwen3.5-9b --device cuda --write "$out/engine_q35.md" \
                    > "$out/engine_q35.log" 2>&1; tail -25 "$out/engine_q35.log"
                "$py" bench_multitenant.py --shape qwen3.5-9b --write "$out/mt_q35.md" \
                    > "$out/mt_q35.log" 2>&1; tail -20 "$out/mt_q35.log" ;;
        # issue 34: the 9B's training step, engine alone against peft (is the 0.25x the daemon's
        # or the engine's?), then a profiled round of 8 adapters (top kernels and ops)
        q35prof) timeout 300 "$py" bench_delta_rule.py --write "$out/delta_rule.md" > "$out/delta_rule.log" 2>&1
                 timeout 300 "$py" bench_delta_rule.py --torch-dqkwg --write "$out/delta_rule.md" \
                     > "$out/delta_rule_dq.log" 2>&1; grep -a "^--" "$out"/delta_rule*.log
                 # without joins (session 10: joins were the daemon's 0.25x; a pass pays the
                 # torch rule's launch-bound chunk loop whatever its rows)
                 printf 'preempt_ms = 0\n' > /tmp/gpu_pass_np.toml
                 "$py" bench_multitenant.py --shape qwen3.5-9b --tenants 8 --skip-fairness --steps 10 \
                     --config /tmp/gpu_pass_np.toml --write "$out/mt_q35_np.md" > "$out/mt_q35_np.log" 2>&1
                 tail -4 "$out/mt_q35_np.log"
                 "$py" bench_engine.py --shape qwen3.5-9b --device cuda --skip-sampling \
                     --write "$out/engine_q35.md" > "$out/engine_q35.log" 2>&1; grep -a "^--\|^|" "$out/engine_q35.log"
                 "$py" profile_engine.py --shape qwen3.5-9b --adapters 8 > "$out/prof_q35.txt" 2>&1
                 head -60 "$out/prof_q35.txt" ;;
        # issue 31: the cookbook rl_loop default step (128 x 16, 512 + 256) through the daemon
        rlstep) "$py" bench_rl_step.py --shape qwen3-8b --model-dir "$ckpt/q8b" --warmup 1 \
                    --steps 1 --write "$out/rl_step.md" > "$out/rl_step.log" 2>&1
                tail -12 "$out/rl_step.log" ;;
        # issue 33, one shape a call (each is most of a call's 10 minutes). The runs' states
        # (0.21 GB a 0.5B run, 1.05 GB an 8B one) need the 4-GPU machines' memory and disk;
        # issue 33 on one GPU of a 2-GPU machine (251 GiB memory, 128 GiB disk), persistence
        # off: 960 trained runs' states (200 GB of the 0.5B, 204 of the 8B) would not fit its
        # disk; parks to disk still write theirs. Host memory (TENANTS_HOST_GB, default 2/3 /
        # 3/4 of the machine's: 167 / 188 GiB there) holds what the GPU bank does not, the
        # disk the rest. The bench's runs come back in a fixed cycle, so the bank and host
        # memory together must hold all 960 or every bring-in reads the disk: torch 2.11
        # rounds pinned memory up (engine/pinned.py), a parked 0.5B run takes 256 MiB there
        # (~650 in 167 GiB, with ~313 in the bank), an 8B one 1 GiB (~185 in 188 GiB).
        # Run `done31` in a call of its own: beside these its 8B part missed its 290 s.
        # One H200 alone (128 GiB, 64 GiB disk) cannot hold the 0.5B's disk parks: use
        # `tenants05h` (192 runs) there.
        tenants05) "$py" bench_tenants.py --shape qwen2.5-0.5b --runs 1000 --active 64 \
                       --config /tmp/gpu_pass_p0.toml --host-gb "${TENANTS_HOST_GB:-$((mem_gb * 2 / 3))}" \
                       --phase-s "${TENANTS_PHASE_S:-150}" --order "${TENANTS_ORDER:-cyclic}" --model-dir "$ckpt/q05" \
                       --write "$out/tenants05.md" > "$out/tenants05.log" 2>&1; tail -20 "$out/tenants05.log"
                   tail -c 30000000 /tmp/bench_tenants_*/twinkled.log > "$out/tenants05_twinkled.log" ;;
        # on one H200 (128 GiB, 64 GiB disk) `tenants05h` keeps 192 runs' parked states in
        # host memory (session 14: with 8 GiB of it the rotation was bound by the disk)
        tenants05h) printf 'adapter_memory_gb = 30\n' > /tmp/gpu_pass_t05.toml
                    "$py" bench_tenants.py --shape qwen2.5-0.5b --runs 192 --active 64 \
                       --config /tmp/gpu_pass_t05.toml --host-gb 64 --phase-s 120 \
                       --write "$out/tenants05h.md" > "$out/tenants05h.log" 2>&1; tail -20 "$out/tenants05h.log" ;;
        # issue 33: what one park and one unpark cost the worker, and the pinned allocation
        # under a park (~30 s)
        park) "$py" bench_park.py --write "$out/park.md" 2>&1 | grep -a "^|" ;;
        # issue 33: the host tier's tests on the card (the arena pinned ahead, parks into it,
        # batched moves; ~1 minute): run before `park` and `tenants05`
        tiercheck) (cd .. && TRITON_INTERPRET=0 TWINKLE_TEST_DEVICE=cuda "$py" -m pytest -q \
                       -p no:cacheprovider tests/test_host_arena.py tests/test_host_memory.py \
                       tests/test_bank_growth.py tests/test_batched_moves.py) 2>&1 | tail -15 \
                       | tee "$out/tiercheck.txt" ;;
        # (the 16 GB checkpoint in memory, /dev/shm, so the disk holds only the runs' states)
        tenants8b) "$py" bench_tenants.py --shape qwen3-8b --runs 200 --active 16 \
                       --config /tmp/gpu_pass_p0.toml --host-gb "${TENANTS_HOST_GB:-$((mem_gb * 3 / 4))}" \
                       --phase-s "${TENANTS_PHASE_S:-150}" --order "${TENANTS_ORDER:-cyclic}" --model-dir /dev/shm/gpu_pass_q8b \
                       --write "$out/tenants8b.md" > "$out/tenants8b.log" 2>&1; tail -20 "$out/tenants8b.log"
                   tail -c 30000000 /tmp/bench_tenants_*/twinkled.log > "$out/tenants8b_twinkled.log" ;;
        # issue 31 item 5: 8 tenants (tinker and openai clients) sampling through the daemon
        # against the same requests in one Engine.sample call
        # (two rounds of 524k new tokens each side: ~5 minutes with the checkpoint written)
        sampdaemon) "$py" bench_sample_daemon.py --shape qwen3-8b --model-dir "$ckpt/q8b" \
                        --rounds 2 --log "$out/sample_daemon_twinkled.log" \
                        --write "$out/sample_daemon.md" > "$out/sample_daemon.log" 2>&1
                    grep -a "^|" "$out/sample_daemon.log" ;;
        # issue 35: the VL shapes through the daemon beside plain peft (2.5 after the patch cache)
        vl) for s in qwen2.5-vl-7b qwen3-vl-8b; do
                "$py" bench_multitenant.py --shape "$s" --tenants 1,8 --packed-baseline \
                    --skip-fairness --steps 10 --write "$out/mt_$s.md" > "$out/mt_$s.log" 2>&1
                tail -6 "$out/mt_$s.log"; done ;;
        # issue 34: gpt-oss and DeepSeek-V3 (reduced depth) shapes, engine and daemon
        arch) for s in gpt-oss-20b deepseek-v3; do
                  "$py" bench_engine.py --shape "$s" --device cuda $([ "$s" = deepseek-v3 ] && echo --skip-peft) \
                      --write "$out/engine_$s.md" > "$out/engine_$s.log" 2>&1; grep -a "^--" "$out/engine_$s.log"
                  # (gpt-oss: a 4,096-token budget leaves the bank room for all 8 of its
                  # 6 GiB adapters; the default's 16K micro-batch left 7, and they thrashed)
                  "$py" bench_multitenant.py --shape "$s" --tenants 8 --skip-fairness --steps 30 \
                      $([ "$s" = gpt-oss-20b ] && echo --packed-baseline --config /tmp/gpu_pass_tb4k.toml) \
                      --write "$out/mt_$s.md" > "$out/mt_$s.log" 2>&1; tail -6 "$out/mt_$s.log"; done ;;
        # issue 34: the RL fan-out sampling figure of the same shapes (engine alone)
        archsamp) for s in gpt-oss-20b deepseek-v3; do
                      timeout 280 "$py" bench_sampling.py --shape "$s" --paths new --no-baseline \
                          --workloads fanout --repeats 1 --write "$out/sampling_$s.md" \
                          > "$out/sampling_$s.log" 2>&1; grep -a "^| fan" "$out/sampling_$s.log"; done ;;
        # sampling under --tp 2: the running batch (eager, and with graphs on trial) against
        # the padded sampler, the same requests (2 GPUs; session 12: 0.62-0.70x, graphs crashed)
        tpsamp) timeout 500 "$py" bench_tp.py --shape qwen3-8b --tp 2 --sample --model-dir "$ckpt/q8b" \
                    > "$out/tpsamp.log" 2>&1; grep -a "^|\|^PATH" "$out/tpsamp.log" ;;
        # gpt-oss-20b at --tp 2 through the daemon (2 GPUs; session 12: 0.91x its 1-GPU figure)
        gpttp2) printf 'devices = ["cuda:0", "cuda:1"]\ntp = 2\ntoken_budget = 4096\nhost_adapter_memory_gb = 64\n' \
                    > /tmp/gpu_pass_gtp2.toml
                "$py" bench_multitenant.py --shape gpt-oss-20b --tenants 8 --skip-fairness --steps 6 \
                    --config /tmp/gpu_pass_gtp2.toml --write "$out/mt_gpt_tp2.md" > "$out/mt_gpt_tp2.log" 2>&1
                tail -4 "$out/mt_gpt_tp2.log" ;;
        # the journal's group commit on this machine's disk, alone and beside a state writer
        journal) for bg in 0 1024; do "$py" bench_journal.py --dir /tmp --background-mb $bg \
                     --write "$out/journal.md" | grep -a "^| "; done ;;
        # issues 37 and 38 through the daemon, on 2 GPUs (nvidia-h200-x2)
        fulld) "$py" bench_full.py --shape qwen3-8b --ranks 2 --daemon --seq 2048 --batch 2 \
                   --out "$out/full_daemon.md" > "$out/full_daemon.log" 2>&1; tail -12 "$out/full_daemon.log" ;;
        longd) "$py" long_daemon.py --shape qwen3-8b --seq 65536,131072 --ranks 2 --cp 2 \
                   --small-steps 6 --out "$out/long_daemon.md" > "$out/long_daemon.log" 2>&1
               grep -a "^--\|^|" "$out/long_daemon.log" ;;
        # issue 38 on 4 GPUs (nvidia-h200-x4): one 8B row at cp 4 (engine), then through the
        # daemon a small tenant on one lane of 2 GPUs beside a 131,072-token row on the other
        long4) "$py" bench_long.py --shape qwen3-8b --seq 65536,131072 --cp 4 --rounds 2 \
                   --out "$out/long_cp4.md" > "$out/long_cp4.log" 2>&1; grep -a "^|\|^rank 0" "$out/long_cp4.log" ;;
        longd4) "$py" long_daemon.py --shape qwen3-8b --seq 131072 --ranks 4 --cp 2 --lanes 2 \
                    --small-steps 6 --out "$out/long_daemon4.md" > "$out/long_daemon4.log" 2>&1
                grep -a "^--\|^|" "$out/long_daemon4.log" ;;
        *) echo "unknown: $what (done31, long4, longd4, loradec, prep, direct, workers, workers4, lanes4, lanes8b, workers8b, lanes, dpnuma, prewrite, sampling, slices, gap, gpucheck, tp, tp32, tp70, moe, qwen35, q35prof, rlstep, tenants05, tenants05h, tenants8b, park, tiercheck, sampdaemon, gappaths, prof8b, grouped, vl, arch, archsamp, tpsamp, gpttp2, journal, fulld, longd)"; exit 2 ;;
    esac
    pack
done
echo "== done $(date +%T)"
