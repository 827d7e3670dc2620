"""Quality-gate records are ordered by the storage's own time of each write (ties by key), never
by the stamp a writer put in the key, and a record that is not one is left out: a stage cannot
lift its own gate by naming a record to sort last (issue 59)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from common import keys
from common.monitor.run_monitor import gate_events, pause_from_storage
from common.reads import foreign_counts, forget_foreign
from common.storage import LocalStorage

RUN = "g"
RESUME = {"accepted": True, "checked": 1, "max_reject_rate": 0.5, "pause_after": 10}


def put(storage: LocalStorage, kind: str, stamp: str, body: object, written_at: float) -> str:
    """A gate record, its write time set as the storage's clock would have."""
    key = keys.gate_event(RUN, kind, stamp)
    assert storage.put_once(key, json.dumps(body).encode())
    os.utime(storage.path / key, (written_at, written_at))
    return key


def test_a_later_pause_wins_over_a_resume_stamped_after_it(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    put(storage, "pause", "20250101T000000.000001-aaaaaa", {"reason": "first", "at": 1.0}, 100)
    # The resume names itself far in the future; the pause below was written after it.
    put(storage, "resume", "99991231T235959.999999-ffffff", RESUME, 200)
    put(storage, "pause", "00000000T000000.000000-000000", {"reason": "second", "at": 3.0}, 300)
    assert [kind for kind, _ in gate_events(storage, RUN)] == ["pause", "resume", "pause"]
    assert pause_from_storage(storage, RUN) == {"reason": "second", "at": 3.0}


def test_records_written_in_the_same_instant_are_ordered_by_key(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    put(storage, "resume", "20250101T000000.000002-bbbbbb", RESUME, 100)
    put(storage, "pause", "20250101T000000.000001-aaaaaa", {"reason": "p", "at": 1.0}, 100)
    assert [kind for kind, _ in gate_events(storage, RUN)] == ["pause", "resume"]


def test_a_record_that_is_not_one_is_left_out_and_counted(tmp_path: Path) -> None:
    forget_foreign()
    storage = LocalStorage(tmp_path)
    put(storage, "pause", "20250101T000000.000001-aaaaaa", {"reason": "p", "at": 1.0}, 100)
    put(storage, "resume", "20250101T000000.000002-bbbbbb", {**RESUME, "accepted": "yes"}, 200)
    put(storage, "resume", "20250101T000000.000003-cccccc", [1, 2], 300)
    assert pause_from_storage(storage, RUN) == {"reason": "p", "at": 1.0}
    assert foreign_counts() == {"gates": 2}
