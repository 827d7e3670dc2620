"""Every read of a stored object typed and bounded: no object a role may write can stop a reader.

    data = read_json(storage, key, COMMIT)             # bytes capped, parsed, validated
    rows = read_rows(storage, part_key, SAMPLE_ROW, cap)   # .jsonl.zst: streamed, rows capped
    try: ... except ForeignObject: ...                 # noted: warned once, counted by area

An object is read with a cap on its bytes (streamed, cut at the cap) and, compressed, on what it
decompresses to (its zstd frame must state its size, as every writer of ours does, and the cap is
checked before a byte is decompressed; a frame that lies is cut where it passes its own size);
a JSONL object is streamed, a line at a time, and cut where it passes its kind's caps on rows and
line bytes (:mod:`common.row_caps`: what an honest one of its run can hold), so memory grows with
the rows kept, never with the bytes read. The decoded value is then validated against its
record's type (:mod:`common.runs.schemas`). An object that fails any of these is
:class:`ForeignObject`, naming the key and why: its caller treats it as foreign (ignored as
if it were not there), and :func:`note` warns once per key and counts it by area
(``status --json``'s ``foreign_objects``). The caps are the ``read`` settings (``DFLASH_READ_*``),
carried by the storage object (:attr:`common.storage.Storage.limits`).
"""

from __future__ import annotations

import io
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import zstandard
from pydantic import TypeAdapter, ValidationError

from common.config import ReadSettings
from common.errors import ForeignObject
from common.json_parse import parse as parse_value
from common.key_layout import parse
from common.row_caps import RowCaps, default_caps
from common.storage import Storage

log = logging.getLogger(__name__)

T = TypeVar("T")
NOTED_AT_MOST = 10_000   # foreign objects warned about per process (a flood stays bounded)
_UNKNOWN_SIZE = zstandard.CONTENTSIZE_UNKNOWN
CHUNK_BYTES = 2**20      # a JSONL object is decompressed this much at a time
_lock = threading.Lock()
_noted: set[str] = set()
_counts: Counter[str] = Counter()


def area_of(key: str) -> str:
    """The layout area a key belongs to, for the counts (``generated``, ``index``, ...)."""
    if key.startswith("dflash:"):
        return "redis"   # a value read from Redis (:func:`read_value`)
    parts = key.split("/")
    if len(parts) > 2 and parts[0] == "runs":
        found = parse(key)
        if found is not None and found.kind.value == "bench verdict":
            return "bench"
        if found is not None and found.area:
            return found.area if found.kind.value != "parking record" else "failed"
        return "run.json" if parts[2] == "run.json" else parts[2]
    return parts[0]


def note(error: ForeignObject) -> None:
    """A foreign object met: warned once per key, counted by area."""
    with _lock:
        if error.key in _noted:
            return
        _counts[area_of(error.key)] += 1
        if len(_noted) >= NOTED_AT_MOST:
            return
        _noted.add(error.key)
    log.warning("ignoring stored object %s: %s (written by hand, or by a key with more access "
                "than its role needs)", error.key, error.why)


def foreign_counts() -> dict[str, int]:
    """Foreign objects this process has met, by area."""
    with _lock:
        return dict(_counts)


def forget_foreign() -> None:
    """Start the counts and the once-per-key warnings afresh (tests, a long-lived reader)."""
    with _lock:
        _noted.clear()
        _counts.clear()


def limits_of(storage: Storage) -> ReadSettings:
    return getattr(storage, "limits", None) or ReadSettings()


def read_bytes(storage: Storage, key: str, cap: int) -> bytes:
    """The object's bytes, at most ``cap`` of them (``NotFound`` if it is not there)."""
    data = storage.get(key, limit=cap)
    if len(data) > cap:
        raise ForeignObject(key, f"larger than {cap:,} bytes")
    return data


def _stated_size(key: str, data: bytes, cap: int) -> int:
    """The size a zstd frame states for its content, which must be stated and within ``cap``."""
    try:
        size = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as exc:
        raise ForeignObject(key, f"not a zstd frame ({exc})") from None
    if size == _UNKNOWN_SIZE:
        raise ForeignObject(key, "its zstd frame does not state its size")
    if size > cap:
        raise ForeignObject(key, f"decompresses to {size:,} bytes, above {cap:,}")
    return size


def decompress(key: str, data: bytes, cap: int) -> bytes:
    """One zstd frame's content, which must state its size and stay within ``cap`` bytes."""
    size = _stated_size(key, data, cap)
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data),
                                                        read_across_frames=False) as reader:
            out = reader.read(size + 1)
    except zstandard.ZstdError as exc:
        raise ForeignObject(key, f"corrupt zstd data ({exc})") from None
    if len(out) != size:
        raise ForeignObject(key, f"its zstd frame holds {len(out):,} bytes, not the "
                                 f"{size:,} it states (truncated or forged)")
    return out


def parse_json(key: str, data: bytes | str) -> Any:
    """The JSON value of an object's (or a Redis value's) bytes: :func:`common.json_parse.parse`,
    depth-limited, NaN refused, any failure :class:`ForeignObject`."""
    return parse_value(key, data)


def read_value(key: str, data: bytes | str, schema: TypeAdapter[T]) -> T:
    """A JSON value read from Redis (``key``: its Redis key), parsed and validated as a stored
    record is: a role may write it too."""
    return validated(key, parse_value(key, data), schema)


def value_or_none(key: str, data: bytes | str, schema: TypeAdapter[T]) -> T | None:
    """A Redis value (:func:`read_value`), or None where it is foreign (noted)."""
    try:
        return read_value(key, data, schema)
    except ForeignObject as exc:
        note(exc)
        return None


def validated(key: str, value: Any, schema: TypeAdapter[T], line: int = 0) -> T:
    """``value`` itself (every field, the ones no reader checks included) once it is a valid
    record of ``schema``'s type (``line``: of a JSONL object)."""
    try:
        schema.validate_python(value)   # its atoms are strict (common.runs.schemas)
        return value  # type: ignore[no-any-return]  # checked just above
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the object"
        at = f"line {line}: " if line else ""
        raise ForeignObject(key, f"{at}not a valid {schema_name(schema)}: {where}: "
                                 f"{first['msg']}") from None


def schema_name(schema: TypeAdapter[Any]) -> str:
    kind = getattr(schema, "_type", None)
    return getattr(kind, "__name__", "record")


def read_json(storage: Storage, key: str, schema: TypeAdapter[T]) -> T:
    """A JSON record, its bytes capped, validated."""
    data = read_bytes(storage, key, limits_of(storage).json_bytes)
    return validated(key, parse_json(key, data), schema)


def read_record(storage: Storage, key: str, schema: TypeAdapter[Any]) -> dict[str, Any]:
    """A JSON object validated by its schema (a TypedDict), as the plain dict a record's
    ``from_json`` takes."""
    record: dict[str, Any] = dict(read_json(storage, key, schema))
    return record


def decode_json(storage: Storage, key: str, data: bytes, schema: TypeAdapter[T]) -> T:
    """A JSON record already fetched (through :func:`bounded_get`), validated."""
    return validated(key, parse_json(key, data), schema)


def decode_json_zst(storage: Storage, key: str, data: bytes, schema: TypeAdapter[T]) -> T:
    """A ``.json.zst`` record already fetched (a run-index object), bounded, validated."""
    raw = decompress(key, data, limits_of(storage).index_decoded_bytes)
    return validated(key, parse_json(key, raw), schema)


def stream_rows(key: str, data: bytes, schema: TypeAdapter[T], cap: RowCaps) -> Iterator[T]:
    """The rows of a ``.jsonl.zst`` object, each validated as it is decompressed: memory grows
    with the rows kept, not the bytes read; past a cap of ``cap``, :class:`ForeignObject`."""
    size = _stated_size(key, data, cap.decoded_bytes)
    for n, line in enumerate(_lines(key, data, size, cap.line_bytes), 1):
        if n > cap.rows:
            raise ForeignObject(key, f"more than {cap.rows:,} lines")
        if line.strip():
            yield validated(key, parse_json(key, line), schema, n)


def _lines(key: str, data: bytes, size: int, line_cap: int) -> Iterator[bytes]:
    """A zstd frame's lines, each at most ``line_cap`` bytes, decompressed a chunk at a time."""
    done = held = 0
    pending: list[bytes] = []
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data),
                                                        read_across_frames=False) as reader:
            while chunk := reader.read(CHUNK_BYTES):
                done += len(chunk)
                if done > size:
                    break
                *whole, tail = chunk.split(b"\n")
                for line in whole:
                    if held + len(line) > line_cap:
                        raise ForeignObject(key, f"a line longer than {line_cap:,} bytes")
                    yield b"".join([*pending, line]) if pending else line
                    pending, held = [], 0
                pending.append(tail)
                held += len(tail)
                if held > line_cap:
                    raise ForeignObject(key, f"a line longer than {line_cap:,} bytes")
    except zstandard.ZstdError as exc:
        raise ForeignObject(key, f"corrupt zstd data ({exc})") from None
    if done != size:
        raise ForeignObject(key, f"its zstd frame holds {'more than ' if done > size else ''}"
                                 f"{done:,} bytes, not the {size:,} it states (truncated or "
                                 "forged)")
    if held:
        yield b"".join(pending)


def _caps(storage: Storage, cap: RowCaps | int | None) -> RowCaps:
    return cap if isinstance(cap, RowCaps) else default_caps(limits_of(storage), cap)


def decode_rows(storage: Storage, key: str, data: bytes, schema: TypeAdapter[T],
                cap: RowCaps | int | None = None) -> list[T]:
    """The rows of a ``.jsonl.zst`` object already fetched, streamed and bounded, each
    validated (``cap``: :func:`common.row_caps.row_caps`, a row cap, or None: the defaults)."""
    return list(stream_rows(key, data, schema, _caps(storage, cap)))


def read_rows(storage: Storage, key: str, schema: TypeAdapter[T],
              cap: RowCaps | int | None = None) -> list[T]:
    """The rows of a part or input shard (``.jsonl.zst``), capped before and after zstd."""
    return decode_rows(storage, key, read_bytes(storage, key, limits_of(storage).part_bytes),
                       schema, cap)


def bounded_get(storage: Storage, cap: Callable[[ReadSettings], int]
                ) -> Callable[[str], bytes]:
    """A getter for :func:`common.runs.commit_cache.fetch` that caps each object's bytes."""
    limit = cap(limits_of(storage))
    return lambda key: read_bytes(storage, key, limit)


def rows_or_none(storage: Storage, key: str, schema: TypeAdapter[T], data: bytes | None = None,
                 cap: RowCaps | int | None = None) -> list[T] | None:
    """A part's or input shard's rows (``data``: already fetched through :func:`bounded_get`;
    ``cap``: as :func:`decode_rows` takes it), or None where the object is foreign (noted):
    readers go on without it."""
    try:
        if data is None:
            return read_rows(storage, key, schema, cap)
        return decode_rows(storage, key, data, schema, cap)
    except ForeignObject as exc:
        note(exc)
        return None


def noting_getter(storage: Storage, cap: Callable[[ReadSettings], int]
                  ) -> Callable[[str], bytes]:
    """:func:`bounded_get`, except that an object past its cap is noted and read as an empty
    body (which the reader then takes as foreign or as no rows)."""
    get = bounded_get(storage, cap)

    def fetched(key: str) -> bytes:
        try:
            return get(key)
        except ForeignObject as exc:
            note(exc)
            return b""
    return fetched


def part_getter(storage: Storage) -> Callable[[str], bytes]:
    """For :func:`common.runs.commit_cache.fetch`: a part's bytes, capped (see
    :func:`noting_getter`; :func:`rows_or_none` reads an empty body)."""
    return noting_getter(storage, lambda limits: limits.part_bytes)
