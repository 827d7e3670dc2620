"""Row validation primitives: the :class:`Conversation` a row becomes, ids, text checks,
message parsing and grouping; ``common.inputs.layouts`` uses them for every row layout.

Assistant messages are dropped (the target model regenerates them); system and user messages
are kept and grouped into ``turns``, one group per assistant reply to generate.

Tool use is context, never regenerated: a ``tool`` message (ShareGPT ``observation``) becomes a
user message ``<tool_response>\n...\n</tool_response>`` (consecutive ones share one message),
and an assistant message with ``tool_calls`` (ShareGPT ``function_call``) that tool results
follow is kept as an assistant message whose content ends with one
``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` per call. That is the text
Qwen3's chat template renders for them, so any template that renders user and assistant
messages (the embedded tiny one included, which has no tool branches) shows the same prompt.
A row's ``tools`` (function definitions, or their JSON text) join the system message the same
way (:func:`tools_text`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from common.errors import BadRow

ID_FIELDS = ("id", "question_id", "conversation_id", "uid", "task_id")
# Reference answers of instruction datasets: large, and regenerated anyway, so kept out of source.
ANSWER_FIELDS = frozenset({"output", "response", "answer", "completion", "chosen", "rejected",
                           "reference", "canonical_solution"})

# "call": an assistant tool call (kept as context when its results follow); "tool": a result.
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
                "function": "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_call": "call",
}

# Lone surrogates survive json.loads ("\ud800") but cannot be encoded as UTF-8 later.
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class Conversation:
    """A validated sample: its id, the message groups to answer, and the row's metadata."""

    id: str
    turns: list[list[dict]]
    source: dict

    def to_json(self) -> dict:
        """Return the JSON-ready form ``{"id", "turns", "source"}``."""
        return {"id": self.id, "turns": self.turns, "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> Conversation:
        """Rebuild a Conversation from :meth:`to_json` output."""
        return cls(id=str(d["id"]), turns=d["turns"], source=d.get("source") or {})


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


def type_name(value: object) -> str:
    """Name a value's type the way reasons print it (``null`` for None)."""
    return "null" if value is None else type(value).__name__


def check_text(value: object, where: str) -> str:
    """Return ``value`` if it is an encodable string, else raise BadRow naming ``where``."""
    if not isinstance(value, str):
        raise BadRow(f"{where} must be a string, got {type_name(value)}")
    if _SURROGATE.search(value):
        raise BadRow(f"{where} contains an unpaired UTF-16 surrogate")
    return value


def parse_messages(
    data: dict, field: str, role_keys: tuple[str, ...], content_keys: tuple[str, ...], roles: dict
) -> list[tuple[str, str]]:
    """Return ``(role, content)`` pairs of a message list, validating types and roles."""
    items = data[field]
    if isinstance(items, str):
        raise BadRow(f"{field} is a string, expected a list of messages (objects with a role "
                     f"and content); use --prompt-field {field} to read it as one prompt")
    if not isinstance(items, list):
        raise BadRow(f"{field} must be a list, got {type_name(items)}")
    messages = []
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
        role = roles[role]
        content_key = next((k for k in content_keys if k in item), content_keys[0])
        if role == "assistant" and item.get("tool_calls"):
            role = "call"
        if role == "call":
            messages.append((role, tool_call_text(item, item.get(content_key), where)))
        elif role == "assistant":
            # Dropped unchecked: regenerated anyway.
            messages.append((role, ""))
        elif role == "tool":
            messages.append((role, _tool_text(item.get(content_key), f"{where}.{content_key}")))
        else:
            content = check_text(item.get(content_key), f"{where}.{content_key}")
            if role == "user" and not content.strip():
                raise BadRow(f"empty user message at {where}")
            messages.append((role, content))
    return messages


def _tool_text(value: object, where: str) -> str:
    """A tool result's text: a string as is, structured results as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return check_text(value, where)
    return json.dumps(value, ensure_ascii=False)


def tool_call_text(item: dict, content: object, where: str) -> str:
    """An assistant tool call as Qwen3's template renders it (see the module docstring)."""
    parts = [] if content is None else [check_text(content, f"{where}.content")]
    calls = item.get("tool_calls")
    if not calls:  # ShareGPT function_call: the value is the call's JSON text
        return "<tool_call>\n" + "".join(parts).strip() + "\n</tool_call>"
    if not isinstance(calls, list):
        raise BadRow(f"{where}.tool_calls must be a list, got {type_name(calls)}")
    for index, call in enumerate(calls):
        call = call.get("function", call) if isinstance(call, dict) else call
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise BadRow(f"{where}.tool_calls[{index}] has no function name")
        arguments = call.get("arguments")
        arguments = arguments if isinstance(arguments, str) else json.dumps(
            arguments, ensure_ascii=False)
        parts.append(f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {arguments}}}'
                     "\n</tool_call>")
    return "\n".join(p for p in parts if p)


def tools_text(tools: object) -> str:
    """The ``# Tools`` block Qwen3's template adds to the system message for ``tools``."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            tools = [tools]
    if not isinstance(tools, list):
        tools = [tools]
    listed = "".join("\n" + (t if isinstance(t, str) else json.dumps(t, ensure_ascii=False))
                     for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>{listed}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def group_turns(messages: list[tuple[str, str]]) -> list[list[dict]]:
    """Group non-assistant messages so that one reply is generated after each group."""
    turns: list[list[dict]] = []
    group: list[dict] = []
    for index, (role, content) in enumerate(messages):
        after = messages[index + 1][0] if index + 1 < len(messages) else None
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if group and group[-1].get("tool"):
                group[-1]["content"] += "\n" + block
            else:
                group.append({"role": "user", "content": block, "tool": True})
            continue
        if role == "call" and after == "tool":
            group.append({"role": "assistant", "content": content})
            continue
        if role not in ("assistant", "call"):
            group.append({"role": role, "content": content})
        elif any(m["role"] == "user" for m in group):
            turns.append(group)
            group = []
        # An assistant message with no user message before it (a greeting) is simply dropped.
    if group:
        has_user = any(m["role"] == "user" for m in group)
        # A trailing system message would be followed by a reply nobody asked for.
        if group[-1]["role"] == "system" and (has_user or turns):
            raise BadRow("conversation ends with a system message")
        if has_user:
            turns.append(group)
    if not turns:
        raise BadRow("no user message")
    for message in (m for group in turns for m in group):
        message.pop("tool", None)
    return turns


def sample_id(data: dict) -> tuple[str | None, str | None, object]:
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


def content_id(turns: list[list[dict]]) -> str:
    """Return ``h-`` plus 16 hex digits of the SHA-256 of the canonical JSON of ``turns``."""
    canonical = json.dumps(turns, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h-" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def jsonable(value: Any) -> Any:
    """Return a strict-JSON copy of ``value``, turning anything else into its ``str``."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        # Replace lone surrogates so the shard writer can always encode the source as UTF-8.
        return (
            value.encode("utf-8", "replace").decode("utf-8") if _SURROGATE.search(value) else value
        )
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)
