"""A warm commit set lists only what can have changed: from the first missing shard on, and
each gap it knows of, never the whole run again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import keys
from common.runs.commit_set import CommitSet
from common.storage import LocalStorage
from tests.test_commit_proof import hidden_commit_body
from tests.test_run_summary import RUN


def test_a_warm_commit_set_lists_once_from_the_first_missing_shard(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    for shard in (0, 1, 2, 5, 130):
        storage.put_once(keys.hidden_commit(RUN, shard), hidden_commit_body(RUN, shard))
    storage.put_once(keys.hidden_part(RUN, 3, 0), b"x")  # under way, not committed
    found = CommitSet(storage, RUN)
    assert found.update(250) == {0, 1, 2, 5, 130}  # cold: chunk by chunk
    calls = _count_lists(storage)
    for shard in (3, 7, 249):  # at the frontier, past it, in the last chunk
        storage.put_once(keys.hidden_commit(RUN, shard), hidden_commit_body(RUN, shard))
    assert found.update(250) == {0, 1, 2, 3, 5, 7, 130, 249}
    assert calls == [(keys.hidden_prefix(RUN), keys.hidden_shard_prefix(RUN, 3).rstrip("/"))]
    assert found.update(250) == {0, 1, 2, 3, 5, 7, 130, 249} and len(calls) == 2


def test_a_warm_commit_set_with_a_few_gaps_lists_them_and_past_the_last(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    for shard in range(260):
        if shard not in (70, 176):  # parked upstream: never reached by this stage
            storage.put_once(keys.hidden_commit(RUN, shard), hidden_commit_body(RUN, shard))
    found = CommitSet(storage, RUN)
    assert len(found.update(400)) == 258
    calls = _count_lists(storage)
    for shard in (176, 260, 399):  # a gap filled, the next shard, the last one
        storage.put_once(keys.hidden_commit(RUN, shard), hidden_commit_body(RUN, shard))
    assert found.update(400) == set(range(261)) - {70} | {399}
    assert sorted(calls) == sorted([
        (keys.hidden_shard_prefix(RUN, 70), ""), (keys.hidden_shard_prefix(RUN, 176), ""),
        (keys.hidden_prefix(RUN), keys.hidden_shard_prefix(RUN, 260).rstrip("/"))])


def _count_lists(storage: LocalStorage) -> list[tuple[str, str]]:
    """From now on, every LIST of ``storage`` as (prefix, start_after)."""
    calls: list[tuple[str, str]] = []
    listing = storage.list

    def counted(prefix: str, start_after: str = "") -> Any:
        calls.append((prefix, start_after))
        return listing(prefix, start_after)

    storage.list = counted  # type: ignore[method-assign]
    return calls
