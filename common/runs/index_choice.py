"""Which of a chunk's index objects a reader tries, in what order, and when it may add one.

Every writer's key may write the index, so any object may be bad: not decodable, foreign,
naming shards without a commit, or holding commits that are not the listed ones. A reader tries
a chunk's objects fullest first (equal counts in listing order), passing each bad one by before
it reads commits directly, and adds an object only where every listed one at least as full is
known bad: a chunk gains at most one object per change of its commits, however many forged ones
lie in its way (issue 65).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from common import keys
from common.storage import Storage

Choice = tuple[str, int]   # an index object's key and the count of commits its key states


def listed_choices(storage: Storage, run: str, kind: str,
                   bad: set[str]) -> dict[int, list[Choice]]:
    """chunk -> its index objects not known bad, in listing order."""
    found: dict[int, list[Choice]] = defaultdict(list)
    for key in storage.list(keys.index_prefix(run, kind)):
        entry = keys.index_entry(key)
        if entry and key not in bad:
            found[entry[0]].append((key, entry[1]))
    return found


def fullest_first(found: Iterable[Choice], proven: int) -> tuple[list[Choice], list[Choice]]:
    """The objects naming no more shards than have a commit, fullest first (ties keep listing
    order), and those that name more (forged: to be passed over)."""
    found = list(found)
    fitting = sorted((c for c in found if c[1] <= proven), key=lambda choice: -choice[1])
    return fitting, [c for c in found if c[1] > proven]


def to_try(choices: Iterable[Choice], read: set[str]) -> list[str]:
    """The keys a scan tries in turn: those before the first one a kept reader has read already
    (what that one holds is known, and so is all a less full one could add)."""
    out = []
    for key, _ in choices:
        if key in read:
            break
        out.append(key)
    return out


def may_write(choices: Iterable[Choice], bad: set[str], count: int) -> bool:
    """True when no listed object of ``count`` commits or more is left that is not known bad
    (such a one is read, or would be, in place of a new one)."""
    return not any(n >= count and key not in bad for key, n in choices)
