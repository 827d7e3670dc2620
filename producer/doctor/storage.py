"""doctor's storage row: a put-once probe in each role's own area, read back, under any key.

Every role's key may write its own area only (``docs/policies``), so the probe goes where the
roles write, ``runs/_access/<area>/doctor-<uuid>`` (``_access`` is never a run id): the areas a
key may write are named, one that may write none (a reader's) is a WARN, not a failure. A probe
is read back and compared (read-after-write), then deleted where the key may delete (the role
keys may not: their probes stay, a few bytes each, outside every run).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from common import keys
from common.engine.preflight import CheckResult
from common.errors import DflashError, StorageRefused
from common.s3_storage import S3Storage
from common.storage import LocalStorage, Storage, open_storage

log = logging.getLogger(__name__)

AREAS = {"generated": "generate worker", "hidden": "hidden worker", "drafter": "train worker",
         "inputs": "producer", "index": "reconciler"}   # each role's own area, and its role
DENIED = ("AccessDenied", "Forbidden", "403")


def check_storage(url: str) -> CheckResult:
    """Probe each role's area with a put-once write, read it back, compare, then delete it."""
    from botocore.exceptions import BotoCoreError

    where, fix = url, "check the path exists and is writable by this user"
    try:
        storage = open_storage(url)
        if isinstance(storage, S3Storage):
            where = f"{url} (endpoint {os.environ.get('AWS_ENDPOINT_URL') or 'AWS default'})"
            fix = "check AWS credentials / bucket exists / AWS_ENDPOINT_URL"
            storage.client = _quick_client()   # gives up in seconds, unlike the pipeline's
        written = [area for area in AREAS if _probe(storage, area)]
        if not written:   # refused everywhere: a read-only key works if it can read
            next(iter(storage.list("runs/")), None)
    except _Differs as exc:
        return CheckResult("storage", ok=False, detail=f"{where}: {exc}",
                           fix="the storage is not read-after-write consistent; check the "
                               "S3-compatible server")
    except (DflashError, BotoCoreError, OSError) as exc:
        return CheckResult("storage", ok=False, detail=f"{where}: {exc}", fix=fix)
    if not written:
        return CheckResult("storage", ok=True, warn=True,
                           detail=f"{where}: this key reads runs/ and may write no area "
                                  f"({', '.join(AREAS)}/): a reader's key",
                           fix="fine for status, report, ui and exports; a worker or the "
                               "producer needs its role's key (docs/policies)")
    roles = ", ".join(f"{area}/ ({AREAS[area]})" for area in written)
    return CheckResult("storage", ok=True,
                       detail=f"wrote and read back a probe at {where} in: {roles}")


class _Differs(DflashError):
    """The probe read back is not what was written."""


def _probe(storage: Storage, area: str) -> bool:
    """True once a probe in ``area`` was written and read back; False if the key may not
    write there; raises on any other error."""
    key, data = keys.doctor_probe(area, uuid.uuid4().hex), uuid.uuid4().bytes
    try:
        if not storage.put_once(key, data):
            raise _Differs(f"probe {key} already existed")
    except StorageRefused as exc:
        if any(code in str(exc) for code in DENIED):
            return False
        raise
    if storage.get(key) != data:
        raise _Differs(f"probe {key} read back differs")
    _delete(storage, key)
    return True


def _delete(storage: Storage, key: str) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        if isinstance(storage, S3Storage):
            storage.client.delete_object(Bucket=storage.bucket, Key=storage.prefix + key)
        elif isinstance(storage, LocalStorage):
            (storage.path / key).unlink(missing_ok=True)
    except (BotoCoreError, ClientError, OSError) as exc:
        # The pipeline itself never deletes, so lacking that permission is no failure.
        log.info("could not delete the doctor probe %s: %s", key, exc)


def _quick_client() -> Any:   # boto3 clients have no importable type
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client("s3", config=Config(
        retries={"mode": "standard", "max_attempts": 2}, connect_timeout=5, read_timeout=15))
