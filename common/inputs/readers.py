"""Streaming readers that turn an input file (local or ``s3://``) into numbered raw records.

``enqueue`` calls :func:`iter_records` once per input file (``common.inputs.sources`` expands what
``--input`` names into files) and feeds each :class:`RawRecord` to ``common.inputs.layouts``.
JSONL (plain, ``.gz``, ``.zst``), Parquet and Arrow are streamed, so memory
stays flat however many rows there are; a ``.json`` array is loaded whole
(``common.inputs.json_rows``: each element with the file line it starts on).
Problems with one JSONL line come back as a record with ``error`` set; problems with the whole
file raise :class:`common.errors.InputError` -- at call time for a missing file or an unknown
extension, during iteration for unreadable content (corrupt Parquet, a broken JSON array,
a truncated compressed stream).
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, cast

from common.choices import Compression, FileKind
from common.errors import InputError
from common.inputs.json_rows import BOM, located_rows

CHUNK_SIZE = 1 << 20
PARQUET_BATCH_ROWS = 1024

# Longest suffixes first, so ".jsonl.gz" wins over a bare ".gz" check.
_SUFFIXES: tuple[tuple[str, FileKind, Compression | None], ...] = (
    (".jsonl.gz", FileKind.JSONL, Compression.GZIP),
    (".ndjson.gz", FileKind.JSONL, Compression.GZIP),
    (".jsonl.zst", FileKind.JSONL, Compression.ZSTD),
    (".ndjson.zst", FileKind.JSONL, Compression.ZSTD),
    (".jsonl", FileKind.JSONL, None),
    (".ndjson", FileKind.JSONL, None),
    (".json", FileKind.JSON, None),
    (".parquet", FileKind.PARQUET, None),
    (".arrow", FileKind.ARROW, None),
)
SUPPORTED_EXTENSIONS = tuple(suffix for suffix, _, _ in _SUFFIXES)



@dataclass(frozen=True, slots=True)
class RawRecord:
    """One input row: ``line`` locates it (``element`` too, in a JSON array); exactly one of
    ``data`` and ``error`` is set."""

    line: int
    data: object | None
    error: str | None
    element: int | None = None


def detect_kind(path: str) -> tuple[FileKind, Compression | None]:
    """Return ``(kind, compression)`` for a path from its extension, or raise InputError."""
    name = path.rsplit("/", 1)[-1].lower()
    for suffix, kind, compression in _SUFFIXES:
        if name.endswith(suffix):
            return kind, compression
    raise InputError(
        f"unsupported input extension: {path!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
    )


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Split a byte stream on ``\\n`` into lines (newline removed), keeping empty lines."""
    # Pieces of an unfinished line are kept in a list so one very long line costs O(n), not O(n^2).
    pending: list[bytes] = []
    for chunk in chunks:
        parts = chunk.split(b"\n")
        if len(parts) == 1:
            if chunk:
                pending.append(chunk)
            continue
        pending.append(parts[0])
        yield b"".join(pending)
        yield from parts[1:-1]
        pending = [parts[-1]] if parts[-1] else []
    if pending:
        yield b"".join(pending)


def parse_jsonl_line(number: int, raw: bytes) -> RawRecord | None:
    """Decode one physical JSONL line into a record, or None for a blank line."""
    offset = 0
    if number == 1 and raw.startswith(BOM):
        raw, offset = raw[len(BOM) :], len(BOM)
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRecord(number, None, f"invalid UTF-8 at byte {exc.start + offset}")
    try:
        return RawRecord(number, json.loads(text), None)
    except json.JSONDecodeError as exc:
        return RawRecord(number, None, f"invalid JSON: {exc.msg} at column {exc.colno}")
    except RecursionError:
        # json raises this, not JSONDecodeError, for absurdly deep nesting.
        return RawRecord(number, None, "invalid JSON: nested too deeply")


def iter_jsonl(chunks: Iterable[bytes]) -> Iterator[RawRecord]:
    """Yield records for every non-blank line of a JSONL byte stream."""
    for number, raw in enumerate(split_lines(chunks), start=1):
        record = parse_jsonl_line(number, raw)
        if record is not None:
            yield record


def _read_chunks(stream: IO[bytes]) -> Iterator[bytes]:
    """Yield fixed-size chunks until EOF."""
    return iter(lambda: stream.read(CHUNK_SIZE), b"")


def _decompressed(stream: IO[bytes],
                  compression: Compression | None) -> tuple[IO[bytes], tuple[Any, ...]]:
    """Wrap a binary stream in its decompressor; also return the errors that mean corrupt data."""
    if compression is Compression.GZIP:
        unzipped = cast(IO[bytes], gzip.GzipFile(fileobj=stream, mode="rb"))  # a binary file
        return unzipped, (OSError, EOFError, zlib.error)
    if compression is Compression.ZSTD:
        import zstandard

        # read_across_frames: files written by pzstd or concatenated .zst hold several frames.
        reader = zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)
        return reader, (OSError, zstandard.ZstdError)
    return stream, (OSError,)


def _jsonl_from_stream(
    stream: IO[bytes], compression: Compression | None, where: str
) -> Iterator[RawRecord]:
    """Yield JSONL records from an open binary stream, turning unreadable data into InputError."""
    reader, errors = _decompressed(stream, compression)
    try:
        yield from iter_jsonl(_read_chunks(reader))
    except errors as exc:
        raise InputError(f"{where}: cannot read data: {exc}") from None
    finally:
        if reader is not stream:
            reader.close()


def _iter_parquet(source: str, where: str) -> Iterator[RawRecord]:
    """Yield one record per Parquet row, numbered from 1, reading a batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(source)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{where}: not a readable Parquet file: {exc}") from None
    number = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                number += 1
                yield RawRecord(number, row, None)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{where}: cannot read Parquet after row {number}: {exc}") from None
    finally:
        parquet.close()


def _iter_arrow(source: str, where: str) -> Iterator[RawRecord]:
    """Yield one record per row of an Arrow file (``datasets.save_to_disk`` writes streams)."""
    import pyarrow as pa

    number = 0
    try:
        with pa.memory_map(source) as mapped:
            try:
                reader = pa.ipc.open_stream(mapped)
            except pa.ArrowInvalid:
                mapped.seek(0)
                file_reader = pa.ipc.open_file(mapped)
                reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            for batch in reader:
                for row in batch.to_pylist():
                    number += 1
                    yield RawRecord(number, row, None)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{where}: cannot read Arrow after row {number}: {exc}") from None


def _iter_json_file(path: str, where: str) -> Iterator[RawRecord]:
    """Yield one record per element of a ``.json`` array, at the file line it starts on."""
    with open(path, "rb") as handle:
        blob = handle.read()
    for line, element, row in located_rows(blob, where):
        yield RawRecord(line, row, None, element)


_WHOLE_FILE_READERS = {FileKind.JSON: _iter_json_file, FileKind.PARQUET: _iter_parquet,
                       FileKind.ARROW: _iter_arrow}
"""Kinds read from a local file (an S3 object is downloaded to a temporary one first)."""


def _iter_local(path: str, kind: FileKind,
                compression: Compression | None) -> Iterator[RawRecord]:
    """Yield records from a local file that is known to exist."""
    try:
        if kind is FileKind.JSONL:
            with open(path, "rb") as handle:
                yield from _jsonl_from_stream(handle, compression, path)
        else:
            yield from _WHOLE_FILE_READERS[kind](path, path)
    except PermissionError as exc:
        raise InputError(f"cannot open input {path}: {exc.strerror}") from None


def split_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/key`` into bucket and key, raising InputError if either is missing."""
    bucket, _, key = url[len("s3://") :].partition("/")
    if not bucket or not key:
        raise InputError(f"malformed S3 URL {url!r}; expected s3://bucket/key")
    return bucket, key


def _open_s3(url: str, s3_client_factory: Callable[[], Any] | None) -> Any:
    """Return the streaming body of an S3 object, mapping a missing key or bucket to InputError."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3_url(url)
    client = s3_client_factory() if s3_client_factory is not None else boto3.client("s3")
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NotFound"):
            raise InputError(f"input not found: {url}") from None
        if code == "NoSuchBucket":
            raise InputError(f"input not found: {url} (no such bucket {bucket!r})") from None
        raise InputError(f"cannot read input {url}: {code or exc}") from None
    except BotoCoreError as exc:
        raise InputError(f"cannot read input {url}: {exc}") from None


def _iter_s3(body: Any, url: str, kind: FileKind,
             compression: Compression | None) -> Iterator[RawRecord]:
    """Yield records from an S3 body: JSONL streamed, JSON and Parquet via a temporary file."""
    from botocore.exceptions import BotoCoreError

    try:
        if kind is FileKind.JSONL and compression is None:
            # Own line splitting over iter_chunks: iter_lines() drops empty lines and would
            # shift every later line number.
            yield from iter_jsonl(body.iter_chunks(CHUNK_SIZE))
            return
        if kind is FileKind.JSONL:
            yield from _jsonl_from_stream(body, compression, url)
            return
        with tempfile.TemporaryDirectory(prefix="dflash-input-") as tmp:
            local = os.path.join(tmp, "input." + kind.value)
            with open(local, "wb") as handle:
                for chunk in body.iter_chunks(CHUNK_SIZE):
                    handle.write(chunk)
            body.close()
            yield from _WHOLE_FILE_READERS[kind](local, url)
    except BotoCoreError as exc:
        # A connection dropped mid-download; the input as a whole could not be read.
        raise InputError(f"cannot read input {url}: {exc}") from None
    finally:
        body.close()


def iter_records(
    path: str | os.PathLike[str], s3_client_factory: Callable[[], Any] | None = None
) -> Iterator[RawRecord]:
    """Return an iterator of raw records from a local path or ``s3://bucket/key`` URL."""
    # A plain function (not a generator) so a missing file or bad extension fails at call time.
    path = os.fspath(path)
    kind, compression = detect_kind(path)
    if path.startswith("s3://"):
        body = _open_s3(path, s3_client_factory)
        return _iter_s3(body, path, kind, compression)
    if not os.path.exists(path):
        raise InputError(f"input not found: {path}")
    if os.path.isdir(path):
        raise InputError(f"input is a directory, not a file: {path}")
    return _iter_local(path, kind, compression)
