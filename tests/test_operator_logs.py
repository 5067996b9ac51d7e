"""JSON logs as a log shipper reads them: a rank's output outside logging becomes JSON
lines. (A daemon's JSON log through a start, requests and a stop, and what its lines say:
tests/test_operator_stop.py, _json_log_says_what_an_operator_looks_for, on the daemon a
signal stops there: a daemon start less.)"""

from __future__ import annotations

import asyncio
import json
import logging


def test_relay_makes_json_of_a_ranks_other_output(capsys):
    """What a rank writes outside logging (a C++ library, a crash, a progress bar's
    redraws) comes through the daemon as JSON lines; its JSON lines pass as they are."""
    from twinkled.protocol.logs import relay, setup_logging

    setup_logging("json")
    try:
        async def go():
            stream = asyncio.StreamReader()
            stream.feed_data(b'[Gloo] Rank 0 is connected\n{"level": "INFO", "message": "m"}\n'
                             b"Loading  0%\rLoading 100%\n")
            stream.feed_eof()
            await relay(stream, "twinkled.worker", rank=3)

        asyncio.run(go())
    finally:
        logging.getLogger().handlers.clear()
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert [x["message"] for x in lines] == ["[Gloo] Rank 0 is connected", "m", "Loading  0%",
                                             "Loading 100%"]
    assert lines[0]["rank"] == 3 and lines[0]["logger"] == "twinkled.worker"
    assert lines[1] == {"level": "INFO", "message": "m"}
