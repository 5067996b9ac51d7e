"""The join port before authentication (issue 28 item 8): a frame bigger than any join
message is cut off by ZeroMQ as it arrives, and a flood of hellos is refused rather than
evicting a real host's pending challenge. The head's HostRegistry on a real socket, with
DEALERs speaking the agent's messages (torch-free, no daemon). (The workers' own socket:
stray bytes on it at start-up are ignored: test_operator_logs.py, on its daemon.)"""

from __future__ import annotations

import asyncio
import os

import zmq
import zmq.asyncio
from daemon import free_port

from twinkled.workers.hosts import HostRegistry, JoinSettings
from twinkled.workers.join import (
    ChallengeF,
    JoinHelloF,
    ProofF,
    RefusedF,
    WelcomeF,
    decoder,
    encoder,
    proof,
)

ANSWER_S = 2.0  # the head answers in milliseconds; a missing answer waits this long


async def _answer(sock: zmq.asyncio.Socket, timeout: float = ANSWER_S):
    if not await sock.poll(int(timeout * 1000)):
        return None
    return decoder.decode(await sock.recv())


def _run(tmp_path, scenario) -> None:
    async def main():
        ctx = zmq.asyncio.Context()
        settings = JoinSettings(f"tcp://127.0.0.1:{free_port()}", tmp_path / "join.key")
        registry = HostRegistry(settings, ctx)
        await registry.open()
        socks: list[zmq.asyncio.Socket] = []

        def dealer() -> zmq.asyncio.Socket:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(settings.listen)
            socks.append(s)
            return s

        try:
            await scenario(registry, dealer)
        finally:
            await registry.close()
            for s in socks:
                s.close(0)
            ctx.term()

    asyncio.run(main())


def test_a_frame_bigger_than_a_join_message_is_dropped_before_authentication(tmp_path):
    async def scenario(registry, dealer):
        big = dealer()  # a 1 MiB hello: a join message is a few hundred bytes
        await big.send(encoder.encode(JoinHelloF("x" * (1 << 20), ["cpu"], os.getpid())))
        assert await _answer(big) is None
        small = dealer()  # and the port still serves hosts
        await small.send(encoder.encode(JoinHelloF("h", ["cpu"], os.getpid())))
        assert isinstance(await _answer(small), ChallengeF)

    _run(tmp_path, scenario)


def test_a_flood_of_hellos_does_not_evict_a_real_hosts_challenge(tmp_path):
    flood = 200  # hellos from other connections, none of which answers its challenge

    async def scenario(registry, dealer):
        real = dealer()
        await real.send(encoder.encode(JoinHelloF("real", ["cpu"], os.getpid())))
        challenge = await _answer(real)
        assert isinstance(challenge, ChallengeF)
        floods = [dealer() for _ in range(flood)]
        for s in floods:
            await s.send(encoder.encode(JoinHelloF("flood", ["cpu"], 1)))
        answers = [await _answer(s) for s in floods]
        refused = [a for a in answers if isinstance(a, RefusedF)]
        assert len(refused) >= flood - 4 and all(a.retry_s > 0 for a in refused)
        await real.send(encoder.encode(ProofF(proof(registry.token, challenge.nonce))))
        assert isinstance(await _answer(real), WelcomeF)
        assert [h.name for h in registry.hosts.values()] == ["real"]

    _run(tmp_path, scenario)
