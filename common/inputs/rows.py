"""Row validation primitives: the :class:`Conversation` a row becomes, ids, text checks,
message parsing and grouping; ``common.inputs.layouts`` uses them for every row layout.

Assistant messages are dropped (the target model regenerates them); system and user messages
are kept and grouped into ``turns``, one group per assistant reply to generate.

Tools are data, never text we write: tool use is context, never regenerated, and every input
layout's tool messages are normalized to the OpenAI structure that chat templates take. A
``tool`` message (ShareGPT ``observation``) stays a ``tool`` message; an assistant message with
``tool_calls`` (ShareGPT ``function_call``) that tool results follow is kept as an assistant
message with ``tool_calls=[{"type": "function", "function": {"name", "arguments"}}]`` (the
arguments an object); a row's ``tools`` become ``[{"type": "function", "function": {...}}]``
(:func:`normalize_tools`). The target's own template renders all of them
(``apply_chat_template(messages, tools=...)``), in its own dialect.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.choices import Role
from common.errors import BadRow
from common.inputs.text import (  # noqa: F401 - re-exported for the layouts
    check_text,
    jsonable,
    type_name,
)
from common.inputs.tools import (  # noqa: F401 - re-exported
    normalize_tools,
    tool_call_message,
    tool_result_message,
    uses_tools,
)

ID_FIELDS = ("id", "question_id", "conversation_id", "uid", "task_id")
# Reference answers of instruction datasets: large, and regenerated anyway, so kept out of source.
ANSWER_FIELDS = frozenset({"output", "response", "answer", "completion", "chosen", "rejected",
                           "reference", "canonical_solution"})

# CALL: an assistant tool call (kept as context when its results follow); TOOL: a result.
OPENAI_ROLES = {"system": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT,
                "tool": Role.TOOL, "function": Role.TOOL}
SHAREGPT_ROLES = {
    "system": Role.SYSTEM,
    "human": Role.USER,
    "user": Role.USER,
    "gpt": Role.ASSISTANT,
    "assistant": Role.ASSISTANT,
    "chatgpt": Role.ASSISTANT,
    "tool": Role.TOOL,
    "observation": Role.TOOL,
    "function_call": Role.CALL,
}



@dataclass(frozen=True, slots=True)
class Conversation:
    """A validated sample: its id, the message groups to answer, the row's metadata, and its
    tool definitions (OpenAI structure; None without tools)."""

    id: str
    turns: list[list[dict[str, Any]]]
    source: dict[str, Any]
    tools: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        """Return the JSON-ready form ``{"id", "turns", "source"}`` (and ``tools``, if any)."""
        out: dict[str, Any] = {"id": self.id, "turns": self.turns, "source": self.source}
        if self.tools:
            out["tools"] = self.tools
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Conversation:
        """Rebuild a Conversation from :meth:`to_json` output."""
        return cls(id=str(d["id"]), turns=d["turns"], source=d.get("source") or {},
                   tools=d.get("tools") or None)


class IdRegistry:
    """Detects duplicate sample ids, holding 8-byte blake2b digests instead of the id strings."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._seen)

    def check_and_add(self, sample_id: str) -> None:
        """Record an id, raising BadRow if it was already recorded."""
        # 64-bit digests: a false duplicate among 10 million ids has odds of about 1 in 400,000.
        digest = hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=8)
        key = digest.digest()
        if key in self._seen:
            raise BadRow(f"duplicate id {sample_id!r}")
        self._seen.add(key)


def parse_messages(
    data: dict[str, Any], field: str, role_keys: tuple[str, ...],
    content_keys: tuple[str, ...], roles: Mapping[str, Role]
) -> list[tuple[Role, Any]]:
    """Return ``(role, content)`` pairs of a message list, validating types and roles; a tool
    call's or tool result's content is its whole normalized message."""
    items = data[field]
    if isinstance(items, str):
        raise BadRow(f"{field} is a string, expected a list of messages (objects with a role "
                     f"and content); use --prompt-field {field} to read it as one prompt")
    if not isinstance(items, list):
        raise BadRow(f"{field} must be a list, got {type_name(items)}")
    messages: list[tuple[Role, Any]] = []
    for index, item in enumerate(items):
        where = f"{field}[{index}]"
        if not isinstance(item, dict):
            raise BadRow(f"{where} must be an object, got {type_name(item)}")
        role_key = next((k for k in role_keys if k in item), role_keys[0])
        role = item.get(role_key)
        if role is None:
            raise BadRow(f"{where} has no {role_key!r}")
        if not isinstance(role, str):
            raise BadRow(f"{where}.{role_key} must be a string, got {type_name(role)}")
        if role not in roles:
            raise BadRow(f"unknown role {role!r} in {where}")
        parsed = roles[role]
        content_key = next((k for k in content_keys if k in item), content_keys[0])
        if parsed is Role.ASSISTANT and item.get("tool_calls"):
            parsed = Role.CALL
        if parsed is Role.CALL:
            messages.append((parsed, tool_call_message(item, item.get(content_key), where)))
        elif parsed is Role.ASSISTANT:
            # Dropped unchecked: regenerated anyway.
            messages.append((parsed, ""))
        elif parsed is Role.TOOL:
            messages.append((parsed, tool_result_message(item, item.get(content_key), where,
                                                         content_key)))
        else:
            content = check_text(item.get(content_key), f"{where}.{content_key}")
            if parsed is Role.USER and not content.strip():
                raise BadRow(f"empty user message at {where}")
            messages.append((parsed, content))
    return messages


def group_turns(messages: list[tuple[Role, Any]]) -> list[list[dict[str, Any]]]:
    """Group non-assistant messages so that one reply is generated after each group; a tool
    call is kept as context when its results follow it."""
    turns: list[list[dict[str, Any]]] = []
    group: list[dict[str, Any]] = []
    for index, (role, content) in enumerate(messages):
        after = messages[index + 1][0] if index + 1 < len(messages) else None
        if role is Role.TOOL:
            group.append(content)
            continue
        if role is Role.CALL and after is Role.TOOL:
            group.append(content)
            continue
        if role not in (Role.ASSISTANT, Role.CALL):
            group.append({"role": role.value, "content": content})
        elif _asks(group):
            turns.append(group)
            group = []
        # An assistant message with no user message before it (a greeting) is simply dropped.
    if group:
        # A trailing system message would be followed by a reply nobody asked for.
        if group[-1]["role"] == Role.SYSTEM and (_asks(group) or turns):
            raise BadRow("conversation ends with a system message")
        if _asks(group):
            turns.append(group)
    if not turns:
        raise BadRow("no user message")
    return turns


def _asks(group: list[dict[str, Any]]) -> bool:
    """A group the target answers: it holds a user message or a tool result."""
    return any(m["role"] in (Role.USER, Role.TOOL) for m in group)


def sample_id(data: dict[str, Any]) -> tuple[str | None, str | None, object]:
    """Return ``(id string, field it came from, original value)``; ``None`` when there is none."""
    for field in ID_FIELDS:
        value = data.get(field)
        if value is None:
            continue
        # bool is an int subclass, but True is not an id anyone meant.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value), field, value
        if isinstance(value, str):
            if not value.strip():
                raise BadRow(f"{field} is an empty string")
            check_text(value, field)
            return value, field, value
        raise BadRow(f"{field} must be a string or integer, got {type_name(value)}")
    return None, None, None


def content_id(turns: list[list[dict[str, Any]]], tools: list[dict[str, Any]] | None = None) -> str:
    """Return ``h-`` plus 16 hex digits of the SHA-256 of the canonical JSON of ``turns`` (and
    of the row's tools, when it has any)."""
    content: object = {"turns": turns, "tools": tools} if tools else turns
    canonical = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h-" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
