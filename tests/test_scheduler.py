"""The scheduler, simulated: fairness by tokens, ordering, barriers, quotas. No torch."""

from __future__ import annotations

import itertools
import random
import sys

from scheduler import SAMPLE, TRAIN, Limits, Planner, Work

_ids = itertools.count()


def work(tenant, kind=TRAIN, tokens=512, model=None, seq=None):
    return Work(f"w{next(_ids)}", tenant, kind, tokens, model, seq)


def flood(p: Planner, tenant: str, model: str, n: int, tokens=512, start=1, optim_every=0):
    """Queue n train ops (with an optim barrier every `optim_every`) for a new model."""
    p.open_model(model, tenant)
    seq = start
    for i in range(n):
        p.submit(work(tenant, TRAIN, tokens, model, seq))
        seq += 1
        if optim_every and (i + 1) % optim_every == 0:
            p.submit(work(tenant, "optim", 0, model, seq))
            seq += 1


def run(p: Planner, until=None, max_steps=100_000):
    """Run steps; returns the list of steps. `until(step_list)` stops early."""
    steps = []
    for _ in range(max_steps):
        s = p.next_step()
        if s is None:
            break
        steps.append(s)
        p.complete(s)
        if until and until(steps):
            break
    return steps


def shares_while_both_busy(p, a, b, steps_fn):
    served = {a: 0, b: 0}
    while True:
        st = p.status()
        if st[a]["queued_requests"] == 0 or st[b]["queued_requests"] == 0:
            break
        s = p.next_step()
        assert s is not None
        p.complete(s)
        if s.kind == "train":
            for w in s.work:
                served[w.tenant] += w.tokens
    total = served[a] + served[b]
    return served[a] / total, served[b] / total


def test_equal_weights_share_equally_when_one_floods_10x():
    p = Planner(token_budget=2048)
    flood(p, "a", "a:0", 200, optim_every=4)
    flood(p, "a", "a:1", 200, optim_every=4)
    flood(p, "b", "b:0", 40, optim_every=4)
    sa, sb = shares_while_both_busy(p, "a", "b", None)
    assert 0.45 <= sa <= 0.55 and 0.45 <= sb <= 0.55, (sa, sb)


def test_weights_3_to_1():
    p = Planner(token_budget=2048)
    p.set_tenant("a", weight=3)
    p.set_tenant("b", weight=1)
    flood(p, "a", "a:0", 400)
    flood(p, "b", "b:0", 400)
    sa, sb = shares_while_both_busy(p, "a", "b", None)
    assert abs(sa - 0.75) <= 0.05 and abs(sb - 0.25) <= 0.05, (sa, sb)


def test_a_newcomer_is_served_in_the_next_step():
    p = Planner(token_budget=2048)
    flood(p, "flood", "f:0", 500)
    flood(p, "flood", "f:1", 500)
    run(p, until=lambda s: len(s) == 50)
    p.open_model("small:0", "small")
    p.submit(work("small", TRAIN, 512, "small:0", 1))
    step = p.next_step()
    assert any(w.tenant == "small" for w in step.work)


def test_a_small_batch_is_not_stuck_behind_a_flood_of_big_ones():
    p = Planner(token_budget=4096)
    flood(p, "flood", "f:0", 300, tokens=4096)
    p.open_model("small:0", "small")
    p.submit(work("small", TRAIN, 64, "small:0", 1))
    steps = run(p, until=lambda s: any(w.tenant == "small" for x in s for w in x.work))
    assert len(steps) <= 2


def test_gaps_are_waited_for_and_chunks_run_together():
    p = Planner()
    p.open_model("m", "t")
    p.submit(work("t", TRAIN, 10, "m", 2))
    p.submit(work("t", TRAIN, 10, "m", 3))
    assert p.next_step() is None  # seq 1 (the first chunk, sent last) is missing
    p.submit(work("t", TRAIN, 10, "m", 1))
    p.submit(work("t", "optim", 0, "m", 4))
    p.submit(work("t", TRAIN, 10, "m", 5))
    step = p.next_step()
    # The chunks run together; the optim right behind them ends the same step.
    assert step.kind == "train" and [w.seq for w in step.work] == [1, 2, 3, 4]
    assert p.next_step() is None  # seq 5 waits for the step (and its optim) to complete
    p.complete(step)
    assert [w.seq for w in p.next_step().work] == [5]


def test_optim_steps_of_several_models_run_as_one_step():
    p = Planner()
    for m in "xyz":
        p.open_model(m, f"t{m}")
        p.submit(work(f"t{m}", TRAIN, 10, m, 1))
        p.submit(work(f"t{m}", "optim", 0, m, 2))
    step = p.next_step()
    train = [w for w in step.work if w.kind == TRAIN]
    optims = [w for w in step.work if w.kind == "optim"]
    assert len(train) == 3 and sorted(w.model for w in optims) == list("xyz")
    assert step.work == train + optims  # rows first, then the optimizer steps together
    # Optims that become ready on their own (no rows this step) also go together.
    for m in "xyz":
        p.submit(work(f"t{m}", "optim", 0, m, 3))
    p.complete(step)
    barrier = p.next_step()
    assert barrier.kind == "barrier" and sorted(w.model for w in barrier.work) == list("xyz")


def test_a_late_optim_step_rides_at_the_end_of_the_next_training_step():
    """An optim_step that came too late to ride behind its model's rows runs after the next
    training step's rows (other models'), not in a barrier step of its own: that step would
    unblock nothing. With rows of its model queued behind it, it runs first, alone."""
    p = Planner()
    for m in "xy":
        p.open_model(m, f"t{m}")
    p.submit(work("tx", TRAIN, 10, "x", 1))
    first = p.next_step()
    p.submit(work("tx", "optim", 0, "x", 2))  # late: x's rows are running
    p.complete(first)
    p.submit(work("ty", TRAIN, 10, "y", 1))
    step = p.next_step()
    assert step.kind == "train"
    assert [(w.model, w.kind) for w in step.work] == [("y", TRAIN), ("x", "optim")]
    p.complete(step)
    # x's optim_step with x's next rows queued behind it: a barrier step first.
    p.submit(work("tx", "optim", 0, "x", 4))
    p.submit(work("tx", TRAIN, 10, "x", 3))
    p.submit(work("tx", TRAIN, 10, "x", 5))
    p.submit(work("ty", TRAIN, 10, "y", 2))
    rows = p.next_step()  # x's rows (3) and y's, with x's optim_step (4) behind its rows
    assert {(w.model, w.kind) for w in rows.work} == {("x", TRAIN), ("y", TRAIN),
                                                       ("x", "optim")}
    p.complete(rows)
    p.submit(work("ty", "optim", 0, "y", 3))
    p.submit(work("ty", TRAIN, 10, "y", 4))
    barrier = p.next_step()  # y has rows behind its optim_step: it runs first
    assert barrier.kind == "barrier" and [w.model for w in barrier.work] == ["y"]


def test_a_withdrawn_sample_leaves_the_queue_and_its_quota():
    p = Planner(sample_budget=100_000)
    p.set_tenant("a", limits=Limits(max_queued_requests=2))
    keep, gone = work("a", SAMPLE, 100), work("a", SAMPLE, 300)
    p.submit(keep)
    p.submit(gone)
    assert p.over_quota("a", 10)
    assert p.withdraw(gone.id, "a") and not p.withdraw(gone.id, "a")
    assert p.status()["a"]["queued_tokens"] == 100 and not p.over_quota("a", 10)
    step = p.next_step()
    assert [w.id for w in step.work] == [keep.id]
    assert not p.withdraw(keep.id, "a")  # planned: it runs
    p.complete(step)
    assert p.idle() and p.status()["a"]["queued_requests"] == 0


def test_samples_and_training_alternate():
    p = Planner(token_budget=512)
    flood(p, "a", "a:0", 100)
    for _ in range(3):
        p.submit(work("b", SAMPLE, 100))
    kinds = [s.kind for s in run(p, until=lambda s: len(s) == 4)]
    assert "sample" in kinds[:2] and "train" in kinds[:2]


def test_the_daemon_may_hold_back_samples_or_training():
    """next_step(samples=False) (the daemon's workers hold samples they cannot start yet):
    training still runs, samples stay queued (withdrawable). next_step(train=False)
    (sampling's turn on the workers): samples come first, training waits."""
    p = Planner(token_budget=512)
    flood(p, "a", "a:0", 2)
    s, later = work("b", SAMPLE, 100), work("b", SAMPLE, 100)
    p.submit(s)
    step = p.next_step(samples=False)
    assert step.kind == "train"
    p.complete(step)
    p.submit(later)
    step = p.next_step(train=False)
    assert step.kind == "sample" and [w.id for w in step.work] == [s.id, later.id]
    p.complete(step)
    assert p.next_step(train=False) is None
    assert p.next_step(samples=False).kind == "train"


def test_quota_holds_work_back_then_admits_it():
    p = Planner(token_budget=10_000)
    p.set_tenant("q", limits=Limits(max_queued_requests=2))
    p.open_model("m", "q")
    ids = []
    for seq in range(1, 6):
        w = work("q", TRAIN, 10, "m", seq)
        ids.append(w.id)
        p.submit(w)
    assert sum(i in p.paused for i in ids) == 3
    assert p.status()["q"]["paused"] == 3
    done = [w.seq for s in run(p) for w in s.work]
    assert done == [1, 2, 3, 4, 5] and not p.paused


def test_a_held_op_that_fills_a_gap_is_admitted():
    """Chunks 2 and 3 fill the quota; chunk 1 must still get in, or nothing ever runs."""
    p = Planner()
    p.set_tenant("q", limits=Limits(max_queued_requests=2))
    p.open_model("m", "q")
    for seq in (2, 3, 1):
        p.submit(work("q", TRAIN, 10, "m", seq))
    assert [w.seq for s in run(p) for w in s.work] == [1, 2, 3]


def test_ten_thousand_random_arrivals_keep_order_and_finish():
    rng = random.Random(7)
    p = Planner(token_budget=4096, sample_budget=2048)
    tenants = [f"t{i}" for i in range(5)]
    for i, t in enumerate(tenants):
        p.set_tenant(t, weight=1 + i % 3, limits=Limits(max_queued_requests=50))
    models = {f"m{i}": tenants[i % 5] for i in range(20)}
    for m, t in models.items():
        p.open_model(m, t)
    next_seq = dict.fromkeys(models, 1)
    backlog = []  # generated but not yet submitted: chunks arrive out of order
    executed: dict[str, list[int]] = {m: [] for m in models}
    completed: dict[str, set[int]] = {m: set() for m in models}
    submitted_at, waits = {}, []
    arrivals, step_no = 0, 0
    while (arrivals < 10_000 or backlog or p.queues.with_work() or any(p.samples.values())
           or p.paused):
        for _ in range(rng.randint(0, 6)):
            if arrivals >= 10_000:
                break
            arrivals += 1
            if rng.random() < 0.15:
                backlog.append(work(rng.choice(tenants), SAMPLE, rng.randint(8, 600)))
                continue
            m = rng.choice(list(models))
            kind = rng.choice([TRAIN] * 6 + ["optim", "save"])
            backlog.append(work(models[m], kind, rng.randint(1, 3000) if kind == TRAIN else 0,
                                m, next_seq[m]))
            next_seq[m] += 1
        rng.shuffle(backlog)
        keep = []
        for w in backlog:  # most arrive now, some later (out of order)
            if rng.random() < 0.7:
                p.submit(w)
                submitted_at[w.id] = step_no
            else:
                keep.append(w)
        backlog = keep
        step = p.next_step()
        step_no += 1
        if step is None:
            continue
        # A step runs its rows first, then its barriers in order (as the daemon does).
        for w in sorted(step.work, key=lambda w: w.is_barrier):
            waits.append(step_no - submitted_at[w.id])
            if w.model is None:
                continue
            if w.is_barrier:  # every earlier op of the model has completed
                assert completed[w.model] >= set(range(1, w.seq)), (w.model, w.seq)
            executed[w.model].append(w.seq)
            completed[w.model].add(w.seq)
        p.complete(step)
        assert step_no < 200_000, "the simulation did not drain"
    for m, seqs in executed.items():
        assert seqs == list(range(1, next_seq[m])), m  # all ran, in order
    assert len(waits) == 10_000 and max(waits) < 5_000
    print(f"max wait {max(waits)} steps over {step_no} steps", file=sys.stderr)


def test_status_reports_shares():
    """`share` is of training time (predicted), not tokens: equal work, about equal shares
    (a tenant alone in a step pays its whole fixed cost)."""
    p = Planner(token_budget=1024)
    flood(p, "a", "a:0", 10)
    flood(p, "b", "b:0", 10)
    run(p)
    st = p.status()
    assert st["a"]["served_tokens"] == st["b"]["served_tokens"] == 5120
    assert abs(st["a"]["share"] - 0.5) < 0.05 and st["a"]["queued_requests"] == 0
    assert st["a"]["served_s"] > 0 and st["a"]["share"] + st["b"]["share"] == 1


def test_a_large_op_is_cut_between_datums_and_others_get_in():
    p = Planner(token_budget=1024)
    p.open_model("big", "flood")
    big = Work("big1", "flood", TRAIN, 10 * 512, "big", 1, parts=[512] * 10)
    p.submit(big)
    p.submit(work("flood", "optim", 0, "big", 2))
    first = p.next_step()
    assert [(w.lo, w.hi, w.final) for w in first.work] == [(0, 2, False)]
    p.complete(first)
    p.open_model("small", "small")
    p.submit(work("small", TRAIN, 512, "small", 1))
    second = p.next_step()
    assert any(w.tenant == "small" for w in second.work)  # not stuck behind the big op
    p.complete(second)
    pieces = [(w.lo, w.hi) for w in first.work + second.work if w.model == "big"]
    steps = run(p)
    pieces += [(w.lo, w.hi) for s in steps for w in s.work if w.model == "big" and w.kind == TRAIN]
    assert pieces[0][0] == 0 and pieces[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))  # in order
    assert steps[-1].work[-1].kind == "optim"  # the optim ran after the last piece
    assert p.status()["flood"]["queued_tokens"] == 0


def test_pieces_cover_every_datum_in_order_and_barrier_waits():
    p = Planner(token_budget=700)
    p.open_model("m", "t")
    p.submit(Work("w", "t", TRAIN, 7 * 300, "m", 1, parts=[300] * 7))
    p.submit(work("t", "optim", 0, "m", 2))
    covered = []
    while (s := p.next_step()) is not None:
        if s.kind == "barrier":
            assert covered == list(range(7))
        for w in s.work:
            if w.kind == TRAIN:
                covered += list(range(w.lo, w.hi if w.hi is not None else 7))
        p.complete(s)
    assert covered == list(range(7))


def test_weights_3_to_1_share_what_contended_steps_split():
    """Issue 30: a weight of 3 showed 53% / 47%. Weights divide a step only when work is
    left waiting; tenants whose requests all fit each step (a tinker client waits for each
    answer) get what they ask, whatever their weights. `share` counts all training time,
    `contended_share` only the steps that left work waiting: 75/25 once both flood."""
    p = Planner(token_budget=2048)
    p.set_tenant("a", weight=3)
    p.set_tenant("b", weight=1)
    p.open_model("a:0", "a")
    p.open_model("b:0", "b")
    for seq in range(1, 41):  # one request at a time each, as a waiting client sends
        p.submit(work("a", TRAIN, 512, "a:0", seq))
        p.submit(work("b", TRAIN, 512, "b:0", seq))
        p.complete(p.next_step())
    st = p.status()
    assert abs(st["a"]["share"] - 0.5) < 0.05  # what the operator saw: no contention
    assert st["a"]["contended_share"] is None and st["b"]["contended_share"] is None
    flood(p, "a", "a:1", 400)
    flood(p, "b", "b:1", 400)
    shares_while_both_busy(p, "a", "b", None)
    st = p.status()
    assert abs(st["a"]["contended_share"] - 0.75) <= 0.05, st
    assert abs(st["b"]["contended_share"] - 0.25) <= 0.05, st
    assert st["a"]["share"] < st["a"]["contended_share"]  # diluted by the early steps
