"""The orjson transcoder writes what eventsourcing's stdlib transcoder writes, and reads it."""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

import pytest
from eventsourcing.persistence import (
    JSONTranscoder,
    TranscodingNotRegisteredError,
)
from hypothesis import given
from hypothesis import strategies as st

from bench.transcoder import registered
from infrastructure.orjson_transcoder import OrjsonTranscoder

STDLIB, ORJSON = registered(JSONTranscoder()), registered(OrjsonTranscoder())

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
    st.uuids(),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.decimals(allow_nan=False, allow_infinity=False),
)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(values)
def test_each_reads_what_the_other_wrote(value: Any) -> None:
    assert ORJSON.decode(STDLIB.encode(value)) == value
    assert STDLIB.decode(ORJSON.encode(value)) == value


def test_the_bytes_are_the_stdlib_transcoders() -> None:
    state = {
        "timestamp": dt.datetime(2026, 12, 3, 16, 0, tzinfo=dt.UTC),
        "deltas": [{"seq": 0, "text": "é ✓", "tokens": 1}],
        "id": uuid.UUID(int=7),
        "price": Decimal("1.50"),
    }
    assert ORJSON.encode(state) == STDLIB.encode(state)


def test_an_unregistered_type_is_refused_like_the_stdlib_does() -> None:
    for transcoder in (STDLIB, ORJSON):
        with pytest.raises(TranscodingNotRegisteredError):
            transcoder.encode({"day": dt.date(2026, 12, 3)})
