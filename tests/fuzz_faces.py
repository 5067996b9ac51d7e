"""The OpenAI face (/oai/api/v1), the Anthropic face (/anthropic/v1) and the admin API
(/admin/v1) for the fuzz (test_fuzz.py): valid requests of each, to be mutated like the
Tinker ones.

The admin requests are the harmless ones (their targets are a tenant of their own and
names that do not exist): a valid mutation must not drain the daemon, revoke the fuzz
tenants' keys or delete their runs. `drain` is checked by hand (test_fuzz.py).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
from hostile import Answer

ADMIN_TENANT = "fz-admin"
# A completion whose mutation lost its max_tokens may run to the end of the context (a
# minute on a busy CPU): the fuzz reads an answer this long, then hangs up (the daemon
# withdraws the samples of a client that went away).
SLOW_S = 5.0
SLOW = "slow"  # Answer.error of a sampling answer cut at SLOW_S


class Faces:
    """httpx clients for the three faces, and their valid requests."""

    def __init__(self, url: str, key: str, data_dir: Path, model: str, timeout: float):
        admin_key = (data_dir / "admin.key").read_text().strip()
        self.oai = httpx.Client(base_url=f"{url}/oai/api/v1", timeout=timeout,
                                headers={"Authorization": f"Bearer {key}"})
        self.anthropic = httpx.Client(base_url=f"{url}/anthropic/v1", timeout=timeout,
                                      headers={"x-api-key": key})
        self.admin = httpx.Client(base_url=f"{url}/admin/v1", timeout=timeout,
                                  headers={"X-Admin-Key": admin_key})
        self.model = model

    def close(self) -> None:
        self.oai.close()
        self.anthropic.close()
        self.admin.close()

    def send(self, face: str, path: str, content: bytes, headers: dict,
             slow_s: float = SLOW_S) -> Answer:
        """The answer (its first 2000 bytes); for a sampling answer still coming after
        slow_s, its status (or None) with error SLOW."""
        client = {"oai": self.oai, "anthropic": self.anthropic}.get(face, self.admin)
        sampling = face != "admin"
        deadline, got = time.monotonic() + slow_s, b""
        timeout = httpx.Timeout(client.timeout.read, read=slow_s) if sampling else None
        status = None
        try:
            with client.stream("POST", path, content=content, headers=headers,
                               timeout=timeout or client.timeout) as r:
                status = r.status_code
                for chunk in r.iter_bytes():
                    got += chunk[:2000 - len(got)]
                    if sampling and time.monotonic() > deadline:
                        return Answer(status, got.decode(errors="replace"), error=SLOW)
                return Answer(status, got.decode(errors="replace"), b"",
                              r.headers.get("content-type", ""))
        except httpx.ReadTimeout as e:
            return Answer(status, error=SLOW if sampling else f"ReadTimeout: {e}")
        except httpx.HTTPError as e:
            return Answer(None, error=f"{type(e).__name__}: {e}"[:300])

    def valid(self, rng: random.Random) -> tuple[str, str, dict]:
        """(face, path, body) of one valid request, of a random kind."""
        return rng.choice(self.text_requests() + self.admin_requests())

    def text_requests(self) -> list[tuple[str, str, dict]]:
        """Valid requests of the two text faces (OpenAI's and Anthropic's)."""
        m = self.model
        return [
            ("oai", "/completions", {"model": m, "prompt": "the sun", "max_tokens": 3,
                                     "temperature": 0.5, "n": 1, "stop": ["\n"],
                                     "logprobs": 2, "seed": 1}),
            ("oai", "/completions", {"model": m, "prompt": [[5, 6, 7], [8, 9]],
                                     "max_tokens": 0, "echo": True, "logprobs": 1}),
            ("oai", "/completions", {"model": m, "prompt": ["a", "b"], "max_tokens": 2,
                                     "stream": True, "stream_options": {"include_usage": True}}),
            ("oai", "/chat/completions", {
                "model": m, "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2,
                "messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
            ("oai", "/chat/completions", {"model": m, "max_tokens": 2, "stream": True, "n": 2,
                                          "messages": [{"role": "user", "content": "hello"}]}),
            # The Anthropic face: the same text path, its own door.
            ("anthropic", "/messages", {
                "model": m, "max_tokens": 3, "temperature": 0.5, "top_k": 4,
                "stop_sequences": ["\n"], "metadata": {"user_id": "fz"},
                "system": [{"type": "text", "text": "be brief"}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                             {"role": "assistant", "content": "Well"}]}),
            ("anthropic", "/messages", {"model": m, "max_tokens": 2, "stream": True,
                                        "messages": [{"role": "user", "content": "hello"}]}),
            ("anthropic", "/messages/count_tokens", {
                "model": m, "system": "be brief",
                "messages": [{"role": "user", "content": "hello"}]}),
        ]

    def admin_requests(self) -> list[tuple[str, str, dict]]:
        t = ADMIN_TENANT
        return [
            ("admin", "/keys_create", {"tenant": t}),
            ("admin", "/keys_list", {"tenant": t}),
            ("admin", "/keys_revoke", {"key": "0000000000"}),
            ("admin", "/tenants_list", {}),
            ("admin", "/tenants_set", {"name": t, "weight": 2.0, "max_rank": 8,
                                       "max_queued_requests": 100, "max_storage_bytes": -1}),
            ("admin", "/runs_list", {"tenant": t, "limit": 5}),
            ("admin", "/runs_show", {"run_id": "no-such-run"}),
            ("admin", "/runs_delete", {"run_id": "no-such-run"}),
            ("admin", "/checkpoints_list", {"tenant": t, "status": "ready"}),
            ("admin", "/checkpoints_delete", {"path": "tinker://no-such-run/weights/x"}),
            ("admin", "/status", {}),
        ]
