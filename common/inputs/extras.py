"""Fields beside a row's turns that add to them, the same in every layout.

- ``system``: becomes the first system message; when the turns already hold a different system
  message, the field is reported as unused (``--strict-fields`` rejects the row) rather than
  one of the two dropped silently.
- ``tools`` (the function definitions of tool-use rows, a list or its JSON text): normalized to
  the OpenAI structure (:func:`common.inputs.rows.normalize_tools`) and kept beside the turns;
  the target's chat template renders them.
- ``history`` (LLaMA-Factory's ``[[user, assistant], ...]`` pairs beside a single prompt): the
  earlier turns; its user messages come first, its assistant ones are regenerated like any other.
"""

from __future__ import annotations

from typing import Any

from common.choices import Role
from common.errors import BadRow
from common.inputs.text import check_text, type_name

Turns = list[list[dict[str, Any]]]


def with_system(turns: Turns, data: dict[str, Any]) -> bool:
    """Put the row's ``system`` field first, unless the conversation already has one; True
    unless the field holds a different system prompt than the conversation's (then unused)."""
    system = data.get("system")
    if system is None:
        return True
    system = check_text(system, "system")
    present = [m["content"] for group in turns for m in group if m["role"] == Role.SYSTEM]
    if present:
        return not system.strip() or system.strip() in (p.strip() for p in present)
    if system.strip():
        turns[0].insert(0, {"role": "system", "content": system})
    return True


def history_turns(data: dict[str, Any]) -> Turns:
    """The user turns of a ``history`` of ``[user, assistant]`` pairs (answers regenerated)."""
    pairs = data.get("history")
    if pairs is None:
        return []
    if not isinstance(pairs, list | tuple):
        raise BadRow(f"history must be a list of [user, assistant] pairs, got "
                     f"{type_name(pairs)}")
    turns = []
    for index, pair in enumerate(pairs):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise BadRow(f"history[{index}] must be a [user, assistant] pair")
        turns += user_turn(nonempty(pair[0], f"history[{index}][0]"))
    return turns


def nonempty(value: object, where: str) -> str:
    text = check_text(value, where)
    if not text.strip():
        raise BadRow(f"empty user message in field {where!r}")
    return text


def user_turn(text: str) -> Turns:
    return [[{"role": "user", "content": text}]]
