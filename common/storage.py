"""Put-once object storage over S3 or a local directory: the pipeline's source of truth.

``open_storage("s3://bucket/prefix")`` or ``open_storage("/data/dflash")``. Every object is
written once: S3 ``PutObject`` with ``If-None-Match: *`` (a 412 means someone already wrote it),
locally a hard link from a fully written temporary file (``link`` fails if the name exists, so
readers never see a half-written object). The S3 endpoint and credentials come from boto3's
standard chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles, instance roles).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common.config import ReadSettings
from common.errors import ConfigError, NotFound, StorageError
from common.storage_api import Storage as Storage
from common.storage_api import StoredObject as StoredObject

log = logging.getLogger(__name__)



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

    def get(self, key: str, limit: int | None = None) -> bytes:
        try:
            with self._file(key).open("rb") as fh:
                if limit is None:
                    return fh.read()
                # Never a buffer larger than the file: a small object under a large cap.
                return fh.read(min(os.fstat(fh.fileno()).st_size, limit + 1))
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

    def list_objects(self, prefix: str, start_after: str = "") -> Iterator[StoredObject]:
        for key in self.list(prefix, start_after):
            try:
                st = self._file(key).stat()
            except FileNotFoundError:
                continue
            # A put-once file never changes: its inode, size and write time name this write.
            yield StoredObject(key, st.st_size, f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}",
                               st.st_mtime)

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


def open_storage(url: str, limits: ReadSettings | None = None) -> Storage:
    """Storage for an ``s3://`` URL or a local directory path; ``limits`` cap what its readers
    take (:mod:`common.reads`; the ``read`` settings, their defaults unless given)."""
    if url.startswith("s3://"):
        from common.s3_storage import S3Storage

        storage: Storage = S3Storage(url)
    elif "://" in url:
        raise ConfigError(f"unsupported storage URL {url!r}: use s3://bucket/prefix or a path")
    else:
        storage = LocalStorage(url)
    storage.limits = limits or ReadSettings()
    return storage


def s3_client() -> Any:   # boto3 clients have no importable type
    """A boto3 S3 client (:func:`common.s3_storage.s3_client`)."""
    from common.s3_storage import s3_client as client

    return client()
