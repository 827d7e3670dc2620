"""What an honest JSONL object (input shard, part) can hold, per kind: caps on its rows, its lines'
bytes and its decompressed bytes, derived from its run's settings where they decide.

    cap = row_caps(RowKind.SAMPLES, config, limits_of(storage))   # config: the run's, or None
    rows = rows_or_none(storage, key, SAMPLE, data, cap)           # past any cap: foreign

An input shard holds at most the run's shard size of rows (enqueue cuts shards at it), and so
does a part of one of its shards (one sample per input row, at most, in each part). A sample's
line holds its prompt (at most ``prompt_bytes``) and what generation added: at most max_turns x
max_new_tokens tokens, each at most ``BYTES_PER_TOKEN`` across the fields that record it. Without
the run's config, the ``read`` settings' defaults apply (``part_rows``, ``row_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from common.choices import RowKind
from common.config import ReadSettings

# A generated token as a sample stores it, at most: its id in output_ids (and in the prompt_ids
# of each later turn's prompt, counted with the prompt), its text JSON-escaped in messages.
BYTES_PER_TOKEN = 64
PROMPT_BYTES = 32 * 2**20   # a sample's prompt side: its input conversation and its token ids


class _Sampling(Protocol):
    @property
    def max_new_tokens(self) -> int: ...


class RunShape(Protocol):
    """What of a run's config decides its objects' caps (:class:`common.runs.records.RunConfig`
    is one)."""

    @property
    def shard_size(self) -> int: ...
    @property
    def max_turns(self) -> int | None: ...
    @property
    def sampling(self) -> _Sampling: ...


@dataclass(frozen=True)
class RowCaps:
    """Caps on one JSONL object: its rows (lines, blank ones counted), one line's bytes and
    the bytes the whole object decompresses to."""

    rows: int
    line_bytes: int
    decoded_bytes: int


def row_caps(kind: RowKind, config: RunShape | None, limits: ReadSettings) -> RowCaps:
    """The caps of an object of ``kind`` of the run ``config`` (None: not at hand)."""
    rows = limits.part_rows
    line = limits.row_bytes
    if config is not None and kind is not RowKind.OTHER:
        rows = min(rows, config.shard_size)
        if kind is RowKind.SAMPLES and config.max_turns is not None:
            generated = config.max_turns * config.sampling.max_new_tokens * BYTES_PER_TOKEN
            line = min(line, PROMPT_BYTES + generated)
    return RowCaps(rows, line, min(limits.part_decoded_bytes, rows * (line + 1)))


def default_caps(limits: ReadSettings, rows: int | None = None) -> RowCaps:
    """The caps where no run's config is at hand (``rows``: a tighter row cap the caller
    knows, e.g. a commit's sample count)."""
    found = row_caps(RowKind.OTHER, None, limits)
    if rows is None or rows >= found.rows:
        return found
    return RowCaps(rows, found.line_bytes, min(found.decoded_bytes, rows * (found.line_bytes + 1)))
