"""The event store's transcoder on orjson: the stdlib JSON transcoder's format, faster.

eventsourcing's :class:`~eventsourcing.persistence.JSONTranscoder` encodes with the standard
library's ``json`` and tags values JSON cannot hold (``{"_type_": "datetime_iso", "_data_":
"..."}``). Under load, encoding token chunks and decoding them again for the views took a
large share of the controller's CPU. This transcoder writes and reads the same tagged JSON
with orjson, so stores written by either decode with the other (tested both ways). orjson
would write UUIDs natively (untagged); they are tagged first, as the stdlib transcoder does,
and dates go through the same registered transcodings, so nothing is stored in a form the
stdlib transcoder would read differently.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any
from uuid import UUID

import orjson
from eventsourcing.persistence import JSONTranscoder

_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
_TAG, _DATA = "_type_", "_data_"


class OrjsonTranscoder(JSONTranscoder):
    def encode(self, obj: Any) -> bytes:
        try:
            return orjson.dumps(_tag_uuids(obj), default=self._encode_obj, option=_OPTIONS)
        except orjson.JSONEncodeError as e:
            if isinstance(e.__cause__, TypeError):
                raise e.__cause__ from None  # e.g. TranscodingNotRegisteredError, as stdlib
            raise

    def decode(self, data: bytes) -> Any:
        return self._revive(orjson.loads(data))

    def _revive(self, value: Any) -> Any:
        """Tagged values revived, in place: what orjson.loads made belongs to nobody else, and
        only containers are visited (a token chunk's deltas hold plain values alone)."""
        kind = type(value)
        if kind is dict:
            if _TAG in value and _DATA in value and len(value) == 2:
                return self._decode_obj(value)
            for key, item in value.items():
                if type(item) in _CONTAINERS:
                    value[key] = self._revive(item)
        elif kind is list:
            for index, item in enumerate(value):
                if type(item) in _CONTAINERS:
                    value[index] = self._revive(item)
        return value


_CONTAINERS = frozenset({dict, list})


_PLAIN = frozenset({str, int, float, bool, type(None)})


def _tag_uuids(value: Any) -> Any:
    """orjson writes UUIDs natively, untagged: tag them the way the stdlib transcoder does.
    Returns ``value`` itself when nothing in it needs a tag (the usual case): no copies."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is dict or kind is list:
        entries = value.items() if kind is dict else enumerate(value)
        copy: Any = None
        for key, item in entries:
            if type(item) in _PLAIN:
                continue
            tagged = _tag_uuids(item)
            if tagged is not item:
                if copy is None:
                    copy = kind(value)
                copy[key] = tagged
        return value if copy is None else copy
    if isinstance(value, UUID):
        return {_TAG: "uuid_hex", _DATA: value.hex}
    if isinstance(value, Decimal):
        return {_TAG: "decimal_str", _DATA: str(value)}
    if isinstance(value, dict | list | tuple):
        return _tag_uuids(dict(value) if isinstance(value, dict) else list(value))
    return value
