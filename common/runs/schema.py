"""Schema numbers of the records a run stores, and the one check every reader makes.

run.json, a shard's ``_COMMIT.json`` (generated and hidden) and a drafter checkpoint's
``_COMMIT.json`` each carry ``"schema": N``. A reader meeting another number (or none) refuses
the record in one line naming both numbers, instead of guessing at a layout it was not written
for: a run is read by the release that wrote it (or one of the same schema).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.errors import SchemaMismatch

RUN_SCHEMA = 1          # runs/<run>/run.json
COMMIT_SCHEMA = 1       # runs/<run>/{generated,hidden}/shard-N/_COMMIT.json
CHECKPOINT_SCHEMA = 1   # runs/<run>/drafter/step-N[.S]/_COMMIT.json
FIELD = "schema"


def check_schema(what: str, data: Mapping[str, Any], expected: int) -> None:
    """Refuse ``data`` (read from ``what``) unless it carries schema ``expected``."""
    found = data.get(FIELD) if isinstance(data, Mapping) else None
    if found != expected:
        shown = "none" if found is None else found
        raise SchemaMismatch(f"{what} has schema {shown}; this release of dflash-pipeline reads "
                             f"schema {expected} (read the run with the release that wrote it)")
