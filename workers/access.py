"""At worker start: the storage takes this stage's writes, else one line names the permission.

A worker whose key may only read (a reader's key given by mistake) would take shards and park
each on its first write; it stops before it takes one instead. The probe is a put-once of
:func:`common.keys.access_probe` in the stage's own area, so it needs exactly the permission the
stage's writes need (``docs/policies/<stage>.json``): the first worker writes it, the next get
"exists" (S3 authorizes a write before it tests the condition), a refused key gets AccessDenied.
"""

from __future__ import annotations

import logging

from common import keys
from common.errors import ConfigError, StorageError, StorageRefused
from common.s3_storage import S3Storage
from common.storage import open_storage

log = logging.getLogger(__name__)

AREAS = {"generate": "generated", "hidden": "hidden", "train": "drafter"}


def check_write_access(storage_url: str, queue: str) -> None:
    """Raise :class:`ConfigError` (one line, exit 1) when the storage refuses the stage's writes."""
    area = AREAS[queue]
    storage = open_storage(storage_url)
    try:
        storage.put_once(keys.access_probe(area), b"this worker's key may write here\n")
    except (StorageRefused, PermissionError) as exc:
        why = str(exc).split(": ", 1)[-1]
        if not isinstance(exc, PermissionError) and not any(
                code in why for code in ("AccessDenied", "Forbidden", "403")):
            raise ConfigError(f"the storage refuses this {queue} worker's writes to "
                              f"{storage.root}: {why}") from None
        needed = (f"s3:PutObject on arn:aws:s3:::{storage.bucket}/{storage.prefix}runs/*/{area}/*"
                  if isinstance(storage, S3Storage) else f"write access to runs/*/{area}/")
        raise ConfigError(f"the storage refuses this {queue} worker's writes ({why}): its key "
                          f"needs {needed} (docs/policies/{queue}.json)") from None
    except StorageError as exc:   # unreachable for now: its tasks retry, as they always do
        log.warning("storage write access not checked at start: %s", exc)
