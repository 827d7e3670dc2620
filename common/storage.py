"""Put-once object storage over S3 or a local directory: the pipeline's source of truth.

``open_storage("s3://bucket/prefix")`` or ``open_storage("/data/dflash")``. Every object is
written once: S3 ``PutObject`` with ``If-None-Match: *`` (a 412 means someone already wrote it),
locally a hard link from a fully written temporary file (``link`` fails if the name exists, so
readers never see a half-written object). The S3 endpoint and credentials come from boto3's
standard chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles, instance roles).
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

from common.errors import ConfigError, NotFound, StorageError, StorageRefused

log = logging.getLogger(__name__)

_CONFLICT_RETRIES = 5


class Storage(ABC):
    """Keys are ``/``-separated paths relative to the root (see :mod:`common.keys`)."""

    root: str

    @abstractmethod
    def put_once(self, key: str, data: bytes) -> bool:
        """Write ``key`` unless it exists; True if this call wrote it, False if it was there."""

    @abstractmethod
    def put_file_once(self, key: str, path: str | os.PathLike[str]) -> bool:
        """:meth:`put_once` of a file's contents, streamed (large exports stay out of memory)."""

    @abstractmethod
    def replace(self, key: str, data: bytes) -> None:
        """Overwrite ``key``: only for pointers (``latest.json``) that readers can rebuild."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the object's bytes or raise :class:`NotFound`."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True when the key has been written."""

    @abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes; :class:`NotFound` if it does not exist."""

    @abstractmethod
    def list(self, prefix: str, start_after: str = "") -> Iterator[str]:
        """Yield every key under ``prefix`` in lexicographic order (only those after
        ``start_after``, a key or any string, when given)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"


class LocalStorage(Storage):
    """A directory standing in for a bucket (the embedded default)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = Path(root).expanduser().resolve()
        self.root = str(self.path)

    def _file(self, key: str) -> Path:
        return self.path / _checked(key)

    def put_once(self, key: str, data: bytes) -> bool:
        def write(tmp: Path) -> None:
            with open(tmp, "xb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())

        return self._link_once(key, write)

    def put_file_once(self, key: str, path: str | os.PathLike[str]) -> bool:
        return self._link_once(key, lambda tmp: shutil.copyfile(path, tmp))

    def _link_once(self, key: str, write: Callable[[Path], object]) -> bool:
        """Write a temporary file, then hard-link it into place: atomic and create-exclusive."""
        final = self._file(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")
        try:
            write(tmp)
            os.link(tmp, final)
        except FileExistsError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot write {final}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def replace(self, key: str, data: bytes) -> None:
        final = self._file(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot write {final}: {exc}") from exc

    def get(self, key: str) -> bytes:
        try:
            return self._file(key).read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(key) from exc
        except OSError as exc:
            raise StorageError(f"cannot read {key}: {exc}") from exc

    def exists(self, key: str) -> bool:
        return self._file(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._file(key).stat().st_size
        except FileNotFoundError as exc:
            raise NotFound(key) from exc

    def list(self, prefix: str, start_after: str = "") -> Iterator[str]:
        parent, _, stem = _checked(prefix).rpartition("/")   # never lists outside the root
        base = self.path / parent if parent else self.path
        if not base.is_dir():
            return iter(())
        root, keys = len(str(self.path)) + 1, []
        tops = [base]
        if stem:  # a name prefix (``shard-0012``) walks only the entries that can match it
            found = [n for n in os.listdir(base) if n.startswith(stem)]
            keys += [f"{parent}/{n}" if parent else n for n in found if (base / n).is_file()]
            tops = [base / n for n in found if (base / n).is_dir()]
        for directory, _, names in (w for top in tops for w in os.walk(top)):  # os.walk: fast
            under = directory[root:].replace(os.sep, "/")
            keys += [f"{under}/{name}" if under else name for name in names
                     if not name.startswith(".")]
        return iter(sorted(k for k in keys if k.startswith(prefix) and k > start_after))


def _checked(key: str) -> str:
    """``key`` (or a listing's prefix), unless it could reach outside the root."""
    if key.startswith("/") or ".." in key.split("/"):
        raise ConfigError(f"invalid storage key {key!r}")
    return key


class S3Storage(Storage):
    """An S3 (or S3-compatible: MinIO, moto) bucket and prefix."""

    def __init__(self, url: str) -> None:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError(f"storage URL {url!r} has no bucket: use s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.root = f"s3://{bucket}/{self.prefix}"

    @cached_property
    def client(self):  # noqa: ANN201 - boto3 clients have no importable type
        return s3_client()

    def put_once(self, key: str, data: bytes) -> bool:
        return self._put_once(key, data)

    def _put_once(self, key: str, body: Any) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        full = self.prefix + key
        for attempt in range(_CONFLICT_RETRIES):
            if hasattr(body, "seek"):
                body.seek(0)
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
                return True
            except ClientError as exc:
                outcome = _s3_outcome(exc)
                if outcome is _Outcome.EXISTS:
                    return False
                if outcome is not _Outcome.CONFLICT:
                    raise _s3_error(exc, f"cannot write {self.root}{key}") from exc
                time.sleep(min(0.1 * 2**attempt, 2.0))
            except BotoCoreError as exc:
                raise StorageError(f"cannot write {self.root}{key}: {exc}") from exc
        raise StorageError(f"cannot write {self.root}{key}: conditional write kept conflicting")

    def put_file_once(self, key: str, path: str | os.PathLike[str]) -> bool:
        with open(path, "rb") as body:  # streamed from the file, never held in memory
            return self._put_once(key, body)

    def replace(self, key: str, data: bytes) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)
        except ClientError as exc:
            raise _s3_error(exc, f"cannot write {self.root}{key}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"cannot write {self.root}{key}: {exc}") from exc

    def get(self, key: str) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        except ClientError as exc:
            raise _s3_error(exc, f"cannot read {self.root}{key}", key) from exc
        except BotoCoreError as exc:
            raise StorageError(f"cannot read {self.root}{key}: {exc}") from exc

    def exists(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return True
        except ClientError as exc:
            if _s3_outcome(exc) is _Outcome.MISSING:
                return False
            raise _s3_error(exc, f"cannot stat {self.root}{key}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"cannot stat {self.root}{key}: {exc}") from exc

    def size(self, key: str) -> int:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)[
                "ContentLength"]
        except ClientError as exc:
            raise _s3_error(exc, f"cannot stat {self.root}{key}", key) from exc
        except BotoCoreError as exc:
            raise StorageError(f"cannot stat {self.root}{key}: {exc}") from exc

    def list(self, prefix: str, start_after: str = "") -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        after = {"StartAfter": self.prefix + start_after} if start_after else {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix, **after
        )
        try:
            for page in pages:
                for obj in page.get("Contents", ()):
                    yield obj["Key"][len(self.prefix) :]
        except ClientError as exc:
            raise _s3_error(exc, f"cannot list {self.root}{prefix}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"cannot list {self.root}{prefix}: {exc}") from exc


class _Outcome(enum.Enum):
    """What an S3 error means to the pipeline."""

    MISSING = "missing"        # the key is not there (NotFound, or False from exists)
    EXISTS = "exists"          # a put-once found the key written already
    CONFLICT = "conflict"      # a concurrent conditional write: try again at once
    TRANSIENT = "transient"    # throttling, 5xx, a timeout: retried, then parked at the cap
    REFUSED = "refused"        # any other 4xx: no retry can fix it, park with the message


# The one table from an S3 error to its outcome: by error code first, then by HTTP status.
_S3_CODES = {"NoSuchKey": _Outcome.MISSING, "NotFound": _Outcome.MISSING,
             "NoSuchBucket": _Outcome.REFUSED,
             "PreconditionFailed": _Outcome.EXISTS, "ConditionalRequestConflict":
             _Outcome.CONFLICT, "SlowDown": _Outcome.TRANSIENT, "Throttling": _Outcome.TRANSIENT,
             "RequestTimeout": _Outcome.TRANSIENT, "RequestTimeTooSkewed": _Outcome.TRANSIENT}
_S3_STATUS = {404: _Outcome.MISSING, 412: _Outcome.EXISTS, 409: _Outcome.CONFLICT,
              408: _Outcome.TRANSIENT, 429: _Outcome.TRANSIENT}


def _s3_outcome(exc: Exception) -> _Outcome:
    code, status = _code(exc), _status(exc)
    if code in _S3_CODES:
        return _S3_CODES[code]
    if status in _S3_STATUS:
        return _S3_STATUS[status]
    return _Outcome.REFUSED if status is not None and 400 <= status < 500 else _Outcome.TRANSIENT


def _s3_error(exc: Exception, doing: str, key: str | None = None) -> StorageError | StorageRefused:
    """The named error for an S3 error, with the service's own message."""
    outcome = _s3_outcome(exc)
    if outcome is _Outcome.MISSING and key is not None:
        return NotFound(key)
    error = getattr(exc, "response", {}).get("Error", {})
    said = f"{error.get('Code', _status(exc))}: {error.get('Message') or exc}"
    if outcome is _Outcome.REFUSED:
        return StorageRefused(f"{doing}: {said}")
    return StorageError(f"{doing}: {said}")


def _status(exc: Exception) -> int | None:
    return getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


def _code(exc: Exception) -> str | None:
    return getattr(exc, "response", {}).get("Error", {}).get("Code")


def s3_client():  # noqa: ANN201
    """A boto3 S3 client with adaptive retries; endpoint and credentials from the AWS chain."""
    import boto3
    from botocore.config import Config

    # Readers fetch with a pool of up to 16 threads (common.runs.commit_cache): one connection each.
    config = Config(retries={"mode": "adaptive", "max_attempts": 10}, connect_timeout=10,
                    max_pool_connections=32)
    # A session of its own: boto3's default session caches the credentials it resolved first,
    # so a process that changes its key (a test, a notebook) would keep using the old one.
    return boto3.session.Session().client("s3", config=config)


def open_storage(url: str) -> Storage:
    """Storage for an ``s3://`` URL or a local directory path."""
    if url.startswith("s3://"):
        return S3Storage(url)
    if "://" in url:
        raise ConfigError(f"unsupported storage URL {url!r}: use s3://bucket/prefix or a path")
    return LocalStorage(url)
