"""The host tier's memory as it is allocated (engine/pinned.py, workers/parked.py): pinned
memory may be rounded up to powers of two (torch builds without exact sizes), so the worker
counts its parked adapters' allocations as they are and refuses a park past its host
budget; the daemon then parks that adapter on disk, and every run trains on to the weights
it reaches alone.
"""

from __future__ import annotations

import pytest
from test_residency_tiers import _create, _scores, _train
from test_service import run, service

from twinkled.engine import pinned
from twinkled.engine.host_arena import ALIGN
from twinkled.protocol.config import Config
from twinkled.protocol.sizing import GiB, adapter_bytes


def test_pinned_bytes_counts_the_rounding_where_the_build_rounds(monkeypatch):
    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: True)
    mib = 2**20
    monkeypatch.setattr(pinned, "_exact", False)  # a build that rounds every allocation
    assert pinned.pinned_bytes(211 * mib) == 256 * mib
    assert pinned.pinned_bytes(70 * mib) == 128 * mib
    assert pinned.pinned_bytes(256 * mib) == 256 * mib
    monkeypatch.setattr(pinned, "_exact", True)  # told to give large ones their size
    assert pinned.pinned_bytes(211 * mib) == 211 * mib
    assert pinned.pinned_bytes(3 * mib) == 4 * mib  # small ones keep the rounding (reuse)
    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: False)
    assert pinned.pinned_bytes(211 * mib) == 211 * mib  # not pinned at all


def test_a_park_past_the_workers_host_budget_is_refused_and_changes_nothing(tiny_dir):
    import torch
    from helpers import adapter_snapshot, ce_request, make_engine

    from twinkled.protocol.types import EngineInputError, LoraConfig
    from twinkled.workers.parked import HostTier

    engine = make_engine(tiny_dir)
    vocab, gen = engine.model.vocab_size, torch.Generator().manual_seed(0)
    for name in "ab":
        engine.add_adapter(name, LoraConfig(rank=4, seed=ord(name)))
        engine.forward_backward([ce_request(name, gen, vocab, [5, 7])])
    params = engine.pool.get("a").bank.flat(engine.pool.get("a").slot, "w").numel()
    # weights and two moments in a piece of the host arena, gradients in another: fp32,
    # their sizes aligned (pinned on a GPU, made ahead)
    one = -(-12 * params // ALIGN) * ALIGN + -(-4 * params // ALIGN) * ALIGN
    tier = HostTier(engine, max_bytes=int(1.5 * one))  # room for one
    allocated = engine.model.device.type == "cuda" and pinned.torch.cuda.memory_allocated()
    tier.park("a")
    assert tier.bytes() == one
    # The park keeps nothing on the card once its copy is done (its snapshot's device copy
    # is let go): the bank keeps its slots, so what the card holds is what it held before
    tier.settle(wait=True)
    assert not allocated or pinned.torch.cuda.memory_allocated() == allocated
    before = adapter_snapshot(engine, "b")
    with pytest.raises(EngineInputError, match="host_adapter_memory_gb.*'b'.*KiB"):
        tier.park("b")
    assert engine.has_adapter("b") and "b" not in tier and tier.bytes() == one
    after = adapter_snapshot(engine, "b")
    assert all(before[k].equal(after[k]) for k in before)  # its slot untouched
    tier.unpark("a")
    tier.park("b")  # room again once a has left
    assert "b" in tier


def test_a_run_parked_between_its_steps_takes_no_room_for_gradients(tiny_dir):
    """A run parked after its optimizer step has no gradients: its host copy is its weights
    and moments (12 bytes a parameter, not 16), and it comes back bit for bit, its gradients
    zero; one parked with gradients pending keeps them."""
    import torch
    from helpers import adapter_snapshot, ce_request, make_engine

    from twinkled.protocol.types import AdamParams, LoraConfig
    from twinkled.workers.parked import HostTier

    engine = make_engine(tiny_dir)
    vocab, gen = engine.model.vocab_size, torch.Generator().manual_seed(0)
    for name in "ab":
        engine.add_adapter(name, LoraConfig(rank=4, seed=ord(name)))
        engine.forward_backward([ce_request(name, gen, vocab, [5, 7])])
    engine.optim_step("a", AdamParams(learning_rate=1e-2))  # a between steps, b not
    params = engine.pool.get("a").bank.flat(engine.pool.get("a").slot, "w").numel()
    before = {m: adapter_snapshot(engine, m) for m in "ab"}
    tier = HostTier(engine)
    tier.park("a")
    assert tier.bytes() == pinned.pinned_bytes(12 * params)
    tier.park("b")
    assert tier.bytes() == (2 * pinned.pinned_bytes(12 * params)
                            + pinned.pinned_bytes(4 * params))
    for m in "ab":
        tier.unpark(m)
        after = adapter_snapshot(engine, m)
        assert all(before[m][k].equal(after[k]) for k in before[m])
    a, b = engine.pool.get("a"), engine.pool.get("b")
    assert not a.bank.flat(a.slot, "g").any() and b.bank.flat(b.slot, "g").any()
    assert (a.pending, b.pending) == (0, 2)  # (two datums)
    # A context-parallel rank's count leaves out its share of split rows: there the
    # gradients themselves say (gradients with no pending datum counted are kept)
    b.pending = 0
    with_grads = adapter_snapshot(engine, "b")
    cp_tier = HostTier(engine, exact_pending=False)
    cp_tier.park("b")
    assert cp_tier.bytes() == pinned.pinned_bytes(12 * params) + pinned.pinned_bytes(4 * params)
    cp_tier.unpark("b")
    after = adapter_snapshot(engine, "b")
    assert all(with_grads[k].equal(after[k]) for k in with_grads)


def test_runs_the_workers_rounded_host_memory_cannot_hold_go_on_to_disk_and_train_on(
        tiny_dir, tmp_path, monkeypatch, caplog):
    """The daemon counts 16 bytes a parameter; the worker's allocations, rounded up as a
    build without exact sizes makes them, take more. A park past the worker's budget is
    refused there; the daemon moves the least recently used in host memory on to disk and
    tries again, so host memory keeps the most recent and the worker never holds more than
    its budget. No request fails, and every run reaches the weights it reaches alone."""
    import twinkled.workers.parked as parked

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)
    # two parked with gradients pending; the daemon counts 12 bytes a parameter: three
    host_budget = 2.5 * one * 16 / 20
    tiers = {"adapter_memory_gb": 2.5 * one / GiB, "host_adapter_memory_gb": host_budget / GiB}
    refused, held = [], []

    def rounded(n: int) -> int:  # a pinned allocation as a rounding build makes it
        return 1 << (n - 1).bit_length()

    park = parked.HostTier.park

    def counting(tier, adapter_id, training=True):
        try:
            park(tier, adapter_id, training)
        except Exception as e:
            refused.append(str(e))
            raise
        held.append(tier.bytes())

    async def train(root, rounding: bool, **config):
        if rounding:
            monkeypatch.setattr(parked, "pinned_bytes", rounded)
            monkeypatch.setattr(parked.HostTier, "park", counting)
        async with service(tiny_dir, root, **config) as box:
            runs = await _create(box, 6)
            seq = await _train(box, runs, 1, 2)
            return await _scores(box, runs, seq), box.svc.lanes.all[0].residency.tiers.status()

    alone, _ = run(train(tmp_path / "alone", False))
    tiered, status = run(train(tmp_path / "tiers", True, **tiers))
    assert refused and "host_adapter_memory_gb" in refused[0] and "KiB" in refused[0]
    assert held and max(held) <= int(host_budget)  # never past the worker's budget
    # each refused park went to host memory after all, the coldest there moving on to disk
    assert not [r for r in caplog.records if "in host memory failed" in r.message]
    assert status["moves"].get("to_disk", 0) > 0 and status["host"] >= 1, status
    for want, have in zip(alone, tiered, strict=True):
        for x, y in zip(want, have, strict=True):
            assert y == pytest.approx(x, abs=1e-4)


def test_pinned_bytes_is_what_the_allocator_takes_on_a_card():
    """On a GPU (TWINKLE_TEST_DEVICE=cuda): `pinned_bytes` says what torch's pinned-memory
    allocator takes for an adapter-sized buffer, rounded or not, so the worker's host budget
    is counted in the memory the machine gives."""
    import torch
    from helpers import DEVICE

    if DEVICE != "cuda":
        pytest.skip("pinned memory: CUDA")
    pinned.exact_sizes()
    stats = torch.cuda.host_memory_stats
    if "allocated_bytes.current" not in stats():
        pytest.skip("this torch build does not report pinned memory")
    n = 211 * 2**20 + 4 * 12345  # (a size no cached block has)
    before = stats()["allocated_bytes.current"]
    buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    assert stats()["allocated_bytes.current"] - before == pinned.pinned_bytes(n)
    print("exact pinned sizes:", pinned.exact_sizes())
    del buf


def test_parks_take_pieces_of_the_arena_and_give_them_back(tiny_dir):
    """With a host budget, the host tier parks into its arena (on a GPU pinned memory made
    ahead: no page-locking in a park; TWINKLE_TEST_DEVICE=cuda), bit for bit; an unpark gives the piece back for
    the next park; a state moved on to disk leaves the arena; past the arena, a park is
    refused for host room (the daemon then spills and tries again)."""
    import torch
    from helpers import DEVICE, adapter_snapshot, make_engine

    from twinkled.protocol.errors import HOST_ROOM
    from twinkled.protocol.types import EngineInputError, LoraConfig
    from twinkled.workers.parked import HostTier

    engine = make_engine(tiny_dir)
    for i in range(3):
        engine.add_adapter(f"a{i}", LoraConfig(rank=4, seed=i))
    a = engine.pool.get("a0")
    state = a.bank.flat(a.slot, "w").nbytes * 3
    # (a budget of one chunk, a power of two, which holds two states)
    tier = HostTier(engine, max_bytes=1 << (2 * -(-state // ALIGN) * ALIGN).bit_length())
    assert tier.arena is not None and tier.arena.wait_filled(60)
    made = []  # (on a CPU made at the first park, not ahead)
    before = {f"a{i}": adapter_snapshot(engine, f"a{i}") for i in range(3)}
    for _ in range(3):  # parks and unparks, over and over, in the same pieces
        tier.park("a0")
        tier.park("a1")
        with pytest.raises(EngineInputError, match="host_adapter_memory_gb"):
            tier.park("a2")
        assert engine.has_adapter("a2")  # refused: still in the bank
        tier.settle(wait=True)
        tier.unpark("a0")
        tier.unpark("a1")
        made.append(tier.arena.made())
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert made == [tier.max_bytes] * 3
    for i in range(3):
        after = adapter_snapshot(engine, f"a{i}")
        assert all(before[f"a{i}"][k].equal(after[k]) for k in after)
    tier.park("a0")
    snap = tier.take("a0")  # for the disk: its own memory, the piece back in the arena
    assert not snap.flat.is_pinned() and "a0" not in tier
    assert tier.arena.free_bytes() == tier.arena.made() - tier.bytes()
    assert snap.flat.numel() * snap.flat.element_size() == state
    tier.park("a1")
    tier.park("a2")  # room again
    # A state no chunk of the budget could hold: said so, not "no host room" (which would
    # have the daemon spill every parked adapter to disk before parking it there)
    aligned = -(-state // ALIGN) * ALIGN  # (room for it, in chunks of less than it)
    small = HostTier(engine, max_bytes=(1 << aligned.bit_length()) - 1)
    assert small.arena.chunk < aligned
    engine.add_adapter("big", LoraConfig(rank=4, seed=9))
    with pytest.raises(EngineInputError, match="more than the host tier's chunks") as e:
        small.park("big")
    assert HOST_ROOM not in str(e.value) and engine.has_adapter("big")


def test_a_build_without_exact_pinned_sizes_counts_the_rounding(monkeypatch):
    """torch 2.11 refuses the option with a ValueError: the worker starts all the same, and
    counts pinned allocations rounded up."""
    def refuse(_):
        raise ValueError("Unrecognized key 'pinned_max_round_threshold_mb' in Accelerator "
                         "allocator config.")

    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned.torch._C, "_accelerator_setAllocatorSettings", refuse)
    monkeypatch.setattr(pinned, "_exact", None)
    assert pinned.exact_sizes() is False
    assert pinned.pinned_bytes(211 * 2**20) == 256 * 2**20


def test_a_host_budget_past_the_machines_memory_is_warned_of_with_the_numbers(tiny_dir):
    from twinkled.server.layout import host_memory_warning

    cfg = Config(model=tiny_dir, host_adapter_memory_gb=160, lanes=1, device="cuda")
    assert host_memory_warning(cfg, machine_bytes=512 * GiB) is None
    warning = host_memory_warning(cfg, machine_bytes=190 * GiB)
    assert warning is not None and "160 x 1 GPU worker(s) = 160 GiB" in warning
    assert "190 GiB" in warning and "lower host_adapter_memory_gb" in warning
    two = Config(model=tiny_dir, host_adapter_memory_gb=100, lanes=2,  # per worker: 200 GiB
                 devices=["cuda:0", "cuda:1"])
    assert "200 GiB" in (host_memory_warning(two, machine_bytes=240 * GiB) or "")
    group = Config(model=tiny_dir, host_adapter_memory_gb=100,  # one lane, 2 ranks: each
                   devices=["cuda:0", "cuda:1"])                # holds every adapter
    assert "2 GPU worker(s) = 200 GiB" in (host_memory_warning(group, machine_bytes=240 * GiB)
                                           or "")
    split = Config(model=tiny_dir, host_adapter_memory_gb=100, tp=2,  # each rank its half
                   devices=["cuda:0", "cuda:1"])
    assert host_memory_warning(split, machine_bytes=240 * GiB) is None
    on_cpu = Config(model=tiny_dir, host_adapter_memory_gb=160, device="cpu")
    assert host_memory_warning(on_cpu, machine_bytes=190 * GiB) is None  # (not pinned)
    import os  # this machine's own memory, read by default

    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert (host_memory_warning(cfg) is None) == (160 * GiB <= 0.8 * machine)
