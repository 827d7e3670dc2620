"""S3 (and S3-compatible: MinIO, moto) storage: put-once by ``If-None-Match: *``, reads capped,
listings with each object's size, ETag and time, and the one table from an S3 error to what it
means to the pipeline. The endpoint and credentials come from boto3's standard chain."""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from common.errors import ConfigError, NotFound, StorageError, StorageRefused
from common.storage_api import Storage, StoredObject

_CONFLICT_RETRIES = 5


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
    def client(self) -> Any:   # boto3 clients have no importable type
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

    def get(self, key: str, limit: int | None = None) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            found = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            body = found["Body"]
            try:
                if limit is None:
                    return bytes(body.read())
                return bytes(body.read(min(int(found.get("ContentLength", limit + 1)), limit + 1)))
            finally:
                body.close()   # past the limit: the rest is never downloaded
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
            return int(self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)[
                "ContentLength"])
        except ClientError as exc:
            raise _s3_error(exc, f"cannot stat {self.root}{key}", key) from exc
        except BotoCoreError as exc:
            raise StorageError(f"cannot stat {self.root}{key}: {exc}") from exc

    def list(self, prefix: str, start_after: str = "") -> Iterator[str]:
        return (found.key for found in self.list_objects(prefix, start_after))

    def list_objects(self, prefix: str, start_after: str = "") -> Iterator[StoredObject]:
        from botocore.exceptions import BotoCoreError, ClientError

        after = {"StartAfter": self.prefix + start_after} if start_after else {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix, **after
        )
        try:
            for page in pages:
                for obj in page.get("Contents", ()):
                    yield StoredObject(obj["Key"][len(self.prefix):], int(obj["Size"]),
                                       str(obj["ETag"]).strip('"'),
                                       obj["LastModified"].timestamp())
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
    status: int | None = getattr(exc, "response", {}).get("ResponseMetadata", {}).get(
        "HTTPStatusCode")
    return status


def _code(exc: Exception) -> str | None:
    code: str | None = getattr(exc, "response", {}).get("Error", {}).get("Code")
    return code


def s3_client() -> Any:   # boto3 clients have no importable type
    """A boto3 S3 client with adaptive retries; endpoint and credentials from the AWS chain."""
    import boto3
    from botocore.config import Config

    # Readers fetch with a pool of up to 16 threads (common.runs.commit_cache): one connection each.
    config = Config(retries={"mode": "adaptive", "max_attempts": 10}, connect_timeout=10,
                    max_pool_connections=32)
    # A session of its own: boto3's default session caches the credentials it resolved first,
    # so a process that changes its key (a test, a notebook) would keep using the old one.
    return boto3.session.Session().client("s3", config=config)


