"""A worker process: one rank of the group, one device, one engine; a busy loop over steps.

Started by the supervisor (`python -m twinkled.workers.worker '<json args>'`). It joins the
torch.distributed group (NCCL on GPUs, gloo on CPUs), loads the model, says hello over its
ZeroMQ DEALER socket, then for each step frame: run it, answer. It dies with its daemon
(PR_SET_PDEATHSIG, and a check of the parent while idle), so no orphan holds a GPU.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import zmq

from twinkled.protocol.blobs import Blobs
from twinkled.protocol.frames import HelloF, ReplyF, encoder, step_decoder

log = logging.getLogger("twinkled.worker")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the idle check below still catches it
        pass


def main(args: dict) -> None:
    rank = args["rank"]
    # The daemon's pid, as it said (a remote host's agent says none): a daemon that died
    # before the prctl below took effect is caught here, not at the first idle check.
    # Forked by a zygote (zygote.py), the parent is the zygote, which kills this rank when
    # the daemon's connection to it closes.
    parent = int(os.environ.get("TWINKLED_FORKED_BY") or 0) or args.get("parent") or os.getppid()
    _die_with_parent()
    if os.getppid() != parent:
        sys.exit(0)
    from twinkled.protocol.logs import setup_logging

    setup_logging(args.get("log_format", "text"),
                  f"%(asctime)s twinkled.worker[{rank}] %(message)s", rank=rank)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{args['group']}:{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args["endpoint"])
    try:
        runner, hello = _start(args)
    except Exception as e:
        log.exception("worker start-up failed")
        sock.send(encoder.encode(HelloF(rank, os.getpid(), args["device"],
                                        error=f"{type(e).__name__}: {e}")))
        # Its reason reaches the daemon before the exit: a rank forked by a zygote ends in
        # os._exit, which would drop a message still queued.
        sock.close(linger=2000)
        zmq.Context.instance().term()
        sys.exit(1)
    sock.send(encoder.encode(hello))
    from twinkled.engine.step import HOST_TIME  # torch is loaded by now
    delay = float(os.environ.get("TWINKLED_TEST_STEP_DELAY", "0"))  # fault tests only
    waiting = False  # changed adapters not yet handed to the writer
    retries = _AllocRetries()
    while True:
        if not sock.poll(50 if waiting else 1000):
            if os.getppid() != parent:  # the daemon is gone
                sys.exit(0)
            waiting = runner.between_steps()
            continue
        received = time.perf_counter()
        step = step_decoder.decode(sock.recv())
        if step.kind == "nudge":  # (it came after the slice it was for had ended)
            continue
        if delay:
            time.sleep(delay)
        try:
            _run_and_reply(sock, runner, rank, step, received, HOST_TIME,
                           between=lambda: _joins(sock, runner, rank, HOST_TIME),
                           joined=step.join,  # (a join that came after its step ended)
                           nudged=lambda: bool(sock.poll(0)))  # (only a nudge comes then)
        except Exception as e:
            # Only what leaves this rank unusable gets here (`rank_io.fatal`: a CUDA or
            # collective fault; a request's own failure is its outcome). The ranks may now
            # disagree, so die: the daemon restarts the group and restores every adapter
            # at its acknowledged step (persisted state + journal).
            log.error("step %d failed: %s", step.id, traceback.format_exc())
            sys.exit(f"step failed: {type(e).__name__}: {e}")
        waiting = runner.between_steps()  # after the reply: off the step's path
        retries.check(runner)


def _run_and_reply(sock, runner, rank: int, step, received: float, host_time,
                   between=None, joined: bool = False, nudged=None) -> None:
    """Run `step` and send its reply (`between`, `joined`, `nudged`: StepRunner.run)."""
    began, started = time.time(), time.perf_counter()
    outcomes = runner.run(step, None if joined else between, joined, nudged)
    if not joined:
        _test_die(rank, step)
    busy = time.perf_counter() - started
    sock.send(encoder.encode(ReplyF(step.id, rank, outcomes, *_memory(runner),
                                    runner.persisted(), busy, began,
                                    {"decode": started - received, **host_time.take()},
                                    runner.sampling_news(step), runner.gaps())))


def _joins(sock, runner, rank: int, host_time) -> None:
    """Between two micro-batches of a training step: run the "join" steps the daemon sent
    meanwhile (a small tenant's work; it sends them to one-rank groups only), each
    answered at once. The step's own gradients wait in their banks untouched."""
    while sock.poll(0):
        received = time.perf_counter()
        step = step_decoder.decode(sock.recv())
        if step.kind != "nudge":  # (one late for the slice it was for)
            _run_and_reply(sock, runner, rank, step, received, host_time, joined=True)


def _start(args: dict):
    import torch
    import torch.distributed as dist

    from twinkled.engine import Engine
    from twinkled.engine.shared_prefix import MIN_SHARED
    from twinkled.protocol.logs import route_transformers

    route_transformers()  # its warnings in our format (JSON too)

    from .persist import Persister
    from .runner import StepRunner

    device = args["device"]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    torch.set_num_threads(max(1, int(args.get("threads") or 1)))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=args["dist_url"],
                            rank=args["rank"], world_size=args["world"],
                            device_id=torch.device(device) if cuda else None)
    dtype = args["dtype"]
    if not cuda and dtype == "bfloat16":
        dtype = "float32"  # bf16 matmuls on a CPU are slow and gain nothing here
    tp, dp_group = None, dist.group.WORLD if args["world"] > 1 else None
    if args.get("tp", 1) > 1:  # megatron-core only here (engine/tp.py)
        from twinkled.engine.tp import TensorParallel

        tp = TensorParallel(args["tp"])
        dp_group = tp.dp_group
    ep = int(args.get("ep", 1))
    experts = None
    if ep > 1:  # expert parallelism (engine/moe_parallel.py)
        from twinkled.engine.moe_parallel import expert_groups

        experts, dp_group = expert_groups(args["rank"], args["world"], ep)
    cp = None
    if int(args.get("cp", 1)) > 1:  # context parallelism (engine/context_parallel.py)
        from twinkled.engine.context_parallel import ContextParallel, cp_groups

        cp = ContextParallel(int(args["cp"]), int(args.get("cp_min_tokens", 8192)),
                             cp_groups(args["rank"], args["world"], int(args["cp"])))
    engine = Engine(args["model"], dtype=dtype, device=device, max_rank=args["max_rank"],
                    token_budget=args["token_budget"], packed=args.get("packing", True),
                    shared_prefix=args.get("shared_prefix", MIN_SHARED),
                    fused=args.get("fused_kernels", "all"),
                    kv_bytes=(args.get("sample_kv_mb") or 0) << 20 or None,
                    sample_rows=args.get("sample_rows", 256),
                    prefix_cache=float(args.get("sample_prefix_cache", 0.0)),
                    dp_group=dp_group, tp=tp, experts=experts,
                    recompute=args.get("activation_checkpointing", "auto"),
                    max_seq_len=args.get("max_seq_len") or None,
                    rope_scaling=args.get("rope_scaling") or None,
                    bank_max_bytes=args.get("bank_max_bytes"))
    if cp is not None and engine.model.sinks is not None:  # (gpt_oss.py: no split attention)
        raise ValueError("cp: context parallelism does not split 'gpt_oss' attention (sinks, "
                         "sliding windows) yet; run it with cp 1")
    persister = None
    if args["rank"] == 0 and args.get("live_dir"):
        persister = Persister(Path(args["live_dir"]), args.get("persist_every", 1))
    cfg = engine.model.config
    model = {"arch": cfg.model_type, "max_seq_len": engine.model.max_seq_len,
             "kv_tokens": engine.kv_tokens,
             "vocab_size": cfg.vocab_size, "dtype": str(engine.model.dtype).replace("torch.", "")}
    hello = HelloF(args["rank"], os.getpid(), device, model)
    seed = None
    if ep > 1:  # one seed base for the group: unseeded samples must draw alike (runner.py)
        t = torch.randint(0, 2**62, (1,), device=device)
        dist.broadcast(t, 0)
        seed = int(t.item())
    runner = StepRunner(engine, args["rank"], args["world"], persister,
                        spans_hosts=args.get("spans_hosts", False), ep=ep, seed=seed,
                        persist_every=args.get("persist_every", 1),
                        gap_every=args.get("logprob_gap_every", 0), cp=cp,
                        blobs=Blobs.from_spec(args.get("checkpoint_store")),
                        host_max_bytes=args.get("host_max_bytes"))
    return runner, hello


class _AllocRetries:
    """Says in the log when torch's CUDA allocator had to free its cache and retry (the
    card's memory fragmented near full: every retry synchronises the device and costs a
    step dearly). Logged the first time and each time the count doubles."""

    def __init__(self):
        self.logged = 0

    def check(self, runner) -> None:
        import torch

        dev = runner.engine.model.device
        if dev.type != "cuda":
            return
        n = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
        if n > 2 * self.logged:  # the first retry, then each doubling
            self.logged = n
            log.warning("the CUDA allocator retried %d time(s) after freeing its cache: "
                        "memory is fragmented near full (PYTORCH_CUDA_ALLOC_CONF="
                        "expandable_segments:True may help)", n)


def _test_die(rank: int, step) -> None:
    """Fault tests only: a rank other than 0 dies after a step that held an optim_step,
    without answering, when the file TWINKLED_TEST_DIE_AFTER_OPTIM names exists (removed:
    once). Rank 0 has answered by then and persists the step behind it."""
    path = os.environ.get("TWINKLED_TEST_DIE_AFTER_OPTIM")
    if not path or rank == 0 or not any(type(op).__name__ == "OptimF" for op in step.ops):
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    time.sleep(1.0)
    os._exit(1)


def _memory(runner) -> tuple[int, int]:
    """Device bytes allocated now, and the most since the start (0, 0 on a CPU)."""
    import torch

    dev = runner.engine.model.device
    if dev.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
