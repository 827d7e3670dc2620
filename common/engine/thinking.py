"""The run's thinking mode: ``on``, ``off`` or ``mix:R`` (a stable share R of conversations,
chosen by id, rendered with thinking off), and each conversation's own mode under it.

A drafter trained only on thinking data collapses when served with thinking off, so a run may
mix both; the choice hashes the id (salted apart from the held-out split's hash), so every
worker, retry and re-render picks the same mode for a conversation.
"""

from __future__ import annotations

import hashlib

ON, OFF, MIX = "on", "off", "mix"
_TRUE = ("on", "true", "1", "yes")
_FALSE = ("off", "false", "0", "no")


def parse_thinking(text: str | bool) -> tuple[bool, float]:
    """``(thinking, share rendered off)`` of an ``on|off|mix:R`` value; ValueError if bad."""
    if isinstance(text, bool):
        return text, 0.0
    value = text.strip().lower()
    if value in _TRUE:
        return True, 0.0
    if value in _FALSE:
        return False, 0.0
    name, sep, share = value.partition(":")
    if name == MIX and sep:
        try:
            ratio = float(share)
        except ValueError:
            ratio = -1.0
        if 0.0 <= ratio <= 1.0:
            return True, ratio
        raise ValueError(f"mix:R needs a share R within [0, 1] of conversations rendered with "
                         f"thinking off, not {share!r}")
    raise ValueError(f"{text!r} is not on, off or mix:R (e.g. mix:0.5)")


def describe(thinking: bool, off_share: float) -> str:
    """The mode as ``--thinking`` takes it."""
    if not thinking:
        return OFF
    return f"{MIX}:{off_share:g}" if off_share > 0 else ON


def thinking_for(thinking: bool, off_share: float, sample_id: str) -> bool:
    """Whether conversation ``sample_id`` renders with thinking on under the run's mode."""
    if not thinking or off_share <= 0:
        return thinking
    digest = hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=8,
                             person=b"dflash-think").digest()
    return int.from_bytes(digest, "big") / 2**64 >= off_share
