"""A worker group's start when its rendezvous port is taken between being picked and being
bound by rank 0 (another process's socket, as the suite's parallel daemons did once): the
group starts again on another port instead of failing the model's load."""

from __future__ import annotations

import asyncio
import socket

from twinkled.core.make_executor import worker_options
from twinkled.protocol.config import Config
from twinkled.workers import supervisor
from twinkled.workers.addresses import free_port


def test_a_rendezvous_port_taken_meanwhile_costs_a_start_not_the_load(tiny_dir, tmp_path,
                                                                      monkeypatch, caplog):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    picked = []

    def pick(host: str = "127.0.0.1") -> int:  # the taken port first, then a free one
        picked.append(taken if not picked else free_port(host))
        return picked[-1]

    monkeypatch.setattr(supervisor, "free_port", pick)
    config = Config(model=tiny_dir, data_dir=tmp_path, device="cpu", dtype="float32",
                    worker_threads=1)
    group = supervisor.WorkerGroup(["cpu"], worker_options(config, ["cpu"]),
                                   start_timeout=120)

    async def go() -> dict:
        try:
            await group.start()
            return group.model_info
        finally:
            await group.stop()

    try:
        info = asyncio.run(asyncio.wait_for(go(), 300))
    finally:
        holder.close()
    assert info and len(picked) == 2 and picked[0] == taken
    assert any("rendezvous port was taken" in r.message for r in caplog.records)
