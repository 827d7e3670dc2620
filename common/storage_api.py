"""What every storage backend is: put-once objects under keys, read capped, listed in order.

:mod:`common.storage` holds the local directory and opens either backend; S3 is
:mod:`common.s3_storage`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from common.config import ReadSettings


@dataclass(frozen=True, slots=True)
class StoredObject:
    """A listed object: its key, size, ETag (what identifies this write of it) and the storage's
    time of the write (S3's ``LastModified``), in seconds since the epoch."""

    key: str
    size: int
    etag: str
    modified: float


class Storage(ABC):
    """Keys are ``/``-separated paths relative to the root (see :mod:`common.keys`); ``limits``
    cap what readers take from it (:mod:`common.reads`)."""

    root: str
    limits: ReadSettings = ReadSettings()

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
    def get(self, key: str, limit: int | None = None) -> bytes:
        """Return the object's bytes (at most ``limit + 1`` of them: streamed and cut, so a
        caller can tell an object past its limit) or raise :class:`NotFound`."""

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

    @abstractmethod
    def list_objects(self, prefix: str, start_after: str = "") -> Iterator[StoredObject]:
        """:meth:`list` with each object's size, ETag and time of writing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"
