"""One reader of uncommitted parts in its own process, its peak RSS over its baseline measured:
``python -m tests.bounded_rows_probe ROOT RUN KEY MODE`` prints what it read as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from common.choices import RowKind
from common.reads import foreign_counts, limits_of, rows_or_none
from common.row_caps import row_caps
from common.runs.schemas import SAMPLE
from common.runs.store import RunStore
from common.storage import open_storage
from producer.ui.series import SeriesReader


def status_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def reset_peak() -> int:
    """The RSS now, with the peak reset to it where the kernel allows (else the peak so far)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass   # the peak so far stands as the baseline: a read can only raise it
    return status_kib("VmHWM")


def main(root: str, run: str, key: str, mode: str) -> dict[str, Any]:
    storage = open_storage(root)
    config = RunStore(storage, run).config()
    cap = row_caps(RowKind.SAMPLES, config, limits_of(storage))
    series = SeriesReader(storage, run)
    base = reset_peak()
    out: dict[str, Any] = {}
    if mode == "capped":      # a reader with the run's config at hand: the shard size caps it
        rows = rows_or_none(storage, key, SAMPLE, cap=cap)
        out["rows"] = None if rows is None else len(rows)
    elif mode == "default":   # status without Redis, the monitor's rebuild: the read defaults
        rows = rows_or_none(storage, key, SAMPLE)
        out["rows"] = None if rows is None else len(rows)
    else:                     # the dashboard's series, asked for live parts
        out["totals"] = series.read(live=True)["totals"]
    out["over_mib"] = (status_kib("VmHWM") - base) / 1024
    out["foreign"] = foreign_counts()
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
