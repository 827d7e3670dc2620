"""A hidden-state shard's writer: records buffered into put-once safetensors parts of about
``part_bytes`` each, then the shard's ``index.json`` (:mod:`common.hidden.store` reads them)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from common import keys
from common.errors import HiddenStateError
from common.hidden.store import (
    DEFAULT_PART_BYTES,
    DTYPES,
    HiddenIndex,
    HiddenMeta,
    HiddenPart,
    HiddenRecord,
    check_record,
    encode_part,
    read_hidden_index,
)
from common.runs.records import dumps
from common.storage import Storage

log = logging.getLogger(__name__)


class HiddenShardWriter:
    """Buffers records and writes them as put-once parts of about ``part_bytes`` each."""

    def __init__(self, storage: Storage, run: str, shard: int, meta: HiddenMeta, *,
                 dtype: str = "bf16", part_bytes: int = DEFAULT_PART_BYTES) -> None:
        if dtype not in DTYPES:
            raise HiddenStateError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self.storage, self.run, self.shard, self.meta = storage, run, shard, meta
        self.dtype, self.part_bytes = dtype, part_bytes
        self.parts: list[HiddenPart] = []
        self._pending: list[HiddenRecord] = []
        self._pending_bytes = 0
        self._seen: set[tuple[str, int]] = set()
        # Start after any part an earlier attempt left, so no upload is wasted on a collision.
        numbers = [keys.part_number(k, ".safetensors")
                   for k in storage.list(keys.hidden_shard_prefix(run, shard))]
        self._next = max((n for n in numbers if n is not None), default=-1) + 1

    def _record_bytes(self, record: HiddenRecord) -> int:
        per_token = self.meta.width + (self.meta.hidden_size if self.meta.has_last else 0)
        return record.tokens * (per_token * DTYPES[self.dtype].itemsize + 5)

    def add(self, records: Iterable[HiddenRecord]) -> None:
        """Check and buffer records; a duplicate (sample id, turn) is dropped, first one wins."""
        for record in records:
            check_record(record, self.meta, finite=False)
            if (record.sample_id, record.turn) in self._seen:
                log.warning("run %s shard %d: duplicate record %s turn %d dropped", self.run,
                            self.shard, record.sample_id, record.turn)
                continue
            self._seen.add((record.sample_id, record.turn))
            self._pending.append(record)
            self._pending_bytes += self._record_bytes(record)
            if self._pending_bytes >= self.part_bytes:
                self.flush()

    def flush(self) -> HiddenPart | None:
        """Write the buffered records as the next free part number."""
        if not self._pending:
            return None
        data = encode_part(self._pending, self.meta, self.dtype)
        while True:
            key = keys.hidden_part(self.run, self.shard, self._next)
            self._next += 1
            if self.storage.put_once(key, data):
                break
            log.warning("run %s shard %d: %s exists, trying the next number", self.run,
                        self.shard, key)
        part = HiddenPart(key=key, sample_ids=[r.sample_id for r in self._pending],
                          turns=[r.turn for r in self._pending],
                          tokens=[r.tokens for r in self._pending], bytes=len(data))
        self.parts.append(part)
        self._pending, self._pending_bytes = [], 0
        return part

    def finish(self) -> HiddenIndex:
        """Flush and write ``index.json`` once; an index written by another attempt wins."""
        self.flush()
        meta = self.meta
        index = HiddenIndex(run=self.run, shard=self.shard, layout=meta.layout,
                            layer_ids=list(meta.layer_ids), hidden_size=meta.hidden_size,
                            num_layers=meta.num_layers, dtype=self.dtype, model=meta.model,
                            parts=list(self.parts))
        if self.storage.put_once(keys.hidden_index(self.run, self.shard), dumps(index.to_json())):
            return index
        log.info("run %s shard %d: index already written by another attempt", self.run,
                 self.shard)
        existing = read_hidden_index(self.storage, self.run, self.shard)
        assert existing is not None  # put_once said it exists
        return existing
