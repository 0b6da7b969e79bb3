"""The event store's transcoder on a token chunk, side by side in one run: eventsourcing's
stdlib ``JSONTranscoder`` and ours (``infrastructure/orjson_transcoder.py``), encoding and
decoding the same TOKEN_STREAM_CHUNK-shaped state (an id, a timestamp, N deltas). Every chunk
is encoded once when recorded and decoded once by the projection follower.

    python -m bench.transcoder              # 20 deltas, 20,000 rounds
    python -m bench.transcoder --deltas 4
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from eventsourcing.persistence import (
    DatetimeAsISO,
    DecimalAsStr,
    JSONTranscoder,
    UUIDAsHex,
)

from infrastructure.orjson_transcoder import OrjsonTranscoder


def registered(transcoder: JSONTranscoder) -> JSONTranscoder:
    """``transcoder`` with the transcodings the event store's state needs (UUIDs, datetimes
    and decimals) registered."""
    for transcoding in (UUIDAsHex(), DatetimeAsISO(), DecimalAsStr()):
        transcoder.register(transcoding)
    return transcoder


def _per_call_us(call: Callable[[], Any], rounds: int) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        call()
    return (time.perf_counter() - started) / rounds * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transcoder", description=__doc__)
    parser.add_argument("--deltas", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20_000)
    args = parser.parse_args(argv)
    state = {
        "originator_id": uuid.uuid4(),
        "originator_version": 42,
        "timestamp": dt.datetime.now(dt.UTC),
        "deltas": [{"seq": i, "text": " token", "tokens": 1} for i in range(args.deltas)],
        "token_count": args.deltas,
    }
    results: dict[str, tuple[float, float]] = {}
    for name, transcoder in (
        ("stdlib", registered(JSONTranscoder())),
        ("orjson", registered(OrjsonTranscoder())),
    ):
        data = transcoder.encode(state)
        assert transcoder.decode(data) == state
        encode = _per_call_us(functools.partial(transcoder.encode, state), args.rounds)
        decode = _per_call_us(functools.partial(transcoder.decode, data), args.rounds)
        results[name] = (encode, decode)
        print(f"{name:7s} encode {encode:6.1f} us   decode {decode:6.1f} us")
    (se, sd), (oe, od) = results["stdlib"], results["orjson"]
    print(f"orjson/stdlib: encode {oe / se:.2f}x the time, decode {od / sd:.2f}x the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
