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
    """A validated sample: its id, the message groups to answer, the row's metadata, and its
    tool definitions (OpenAI structure; None without tools)."""

    id: str
    turns: list[list[dict]]
    source: dict
    tools: list[dict] | None = None

    def to_json(self) -> dict:
        """Return the JSON-ready form ``{"id", "turns", "source"}`` (and ``tools``, if any)."""
        out = {"id": self.id, "turns": self.turns, "source": self.source}
        if self.tools:
            out["tools"] = self.tools
        return out

    @classmethod
    def from_json(cls, d: dict) -> Conversation:
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
) -> list[tuple[str, Any]]:
    """Return ``(role, content)`` pairs of a message list, validating types and roles; a tool
    call's or tool result's content is its whole normalized message."""
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
            messages.append((role, tool_call_message(item, item.get(content_key), where)))
        elif role == "assistant":
            # Dropped unchecked: regenerated anyway.
            messages.append((role, ""))
        elif role == "tool":
            messages.append((role, tool_result_message(item, item.get(content_key), where,
                                                       content_key)))
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


def tool_result_message(item: dict, content: object, where: str, content_key: str) -> dict:
    """A ``role: tool`` message: its text, and the call id and name when the row gives them."""
    message = {"role": "tool", "content": _tool_text(content, f"{where}.{content_key}")}
    for key in ("tool_call_id", "name"):
        if isinstance(item.get(key), str):
            message[key] = check_text(item[key], f"{where}.{key}")
    return message


def _arguments(value: object, where: str) -> dict:
    """A call's arguments as an object (templates iterate them); JSON text is parsed."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise BadRow(f"{where}.arguments is not JSON: {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise BadRow(f"{where}.arguments must be an object, got {type_name(value)}")
    return value


def _call(call: object, where: str) -> dict:
    """One call in the OpenAI structure: ``{"type": "function", "function": {...}}``."""
    function = call.get("function", call) if isinstance(call, dict) else call
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"].strip():
        raise BadRow(f"{where} has no function name")
    out = {"type": "function", "function": {
        "name": check_text(function["name"], f"{where}.name"),
        "arguments": _arguments(function.get("arguments"), where)}}
    if isinstance(call, dict) and isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def tool_call_message(item: dict, content: object, where: str) -> dict:
    """An assistant tool call as an OpenAI message: its text (if any) and its ``tool_calls``."""
    calls = item.get("tool_calls")
    if not calls:  # ShareGPT function_call: the value is the call's JSON text
        text = check_text(content, f"{where}.value") if content is not None else ""
        try:
            parsed = json.loads(text)
        except ValueError:
            raise BadRow(f"{where} is a function_call whose value is not JSON: "
                         f"{text[:80]!r}") from None
        return {"role": "assistant", "content": "", "tool_calls": [_call(parsed, where)]}
    if not isinstance(calls, list):
        raise BadRow(f"{where}.tool_calls must be a list, got {type_name(calls)}")
    text = "" if content is None else check_text(content, f"{where}.content")
    return {"role": "assistant", "content": text,
            "tool_calls": [_call(call, f"{where}.tool_calls[{i}]")
                           for i, call in enumerate(calls)]}


def normalize_tools(tools: object) -> list[dict]:
    """A row's tool definitions (a list, one object, or their JSON text) in the OpenAI
    structure ``[{"type": "function", "function": {"name", ...}}]``."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise BadRow(f"tools is not JSON: {tools[:80]!r}") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise BadRow(f"tools must be a list of function definitions, got {type_name(tools)}")
    out = []
    for index, tool in enumerate(tools):
        if isinstance(tool, str):
            try:
                tool = json.loads(tool)
            except ValueError:
                raise BadRow(f"tools[{index}] is not JSON: {tool[:80]!r}") from None
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRow(f"tools[{index}] is not a function definition (no name)")
        out.append({"type": "function", "function": jsonable(function)})
    return out


def group_turns(messages: list[tuple[str, Any]]) -> list[list[dict]]:
    """Group non-assistant messages so that one reply is generated after each group; a tool
    call is kept as context when its results follow it."""
    turns: list[list[dict]] = []
    group: list[dict] = []
    for index, (role, content) in enumerate(messages):
        after = messages[index + 1][0] if index + 1 < len(messages) else None
        if role == "tool":
            group.append(content)
            continue
        if role == "call" and after == "tool":
            group.append(content)
            continue
        if role not in ("assistant", "call"):
            group.append({"role": role, "content": content})
        elif _asks(group):
            turns.append(group)
            group = []
        # An assistant message with no user message before it (a greeting) is simply dropped.
    if group:
        # A trailing system message would be followed by a reply nobody asked for.
        if group[-1]["role"] == "system" and (_asks(group) or turns):
            raise BadRow("conversation ends with a system message")
        if _asks(group):
            turns.append(group)
    if not turns:
        raise BadRow("no user message")
    return turns


def _asks(group: list[dict]) -> bool:
    """A group the target answers: it holds a user message or a tool result."""
    return any(m["role"] in ("user", "tool") for m in group)


def uses_tools(row: dict) -> bool:
    """A row whose rendering needs the template's tool branches."""
    return bool(row.get("tools")) or any(
        m["role"] == "tool" or m.get("tool_calls") for group in row["turns"] for m in group)


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


def content_id(turns: list[list[dict]], tools: list[dict] | None = None) -> str:
    """Return ``h-`` plus 16 hex digits of the SHA-256 of the canonical JSON of ``turns`` (and
    of the row's tools, when it has any)."""
    content: object = {"turns": turns, "tools": tools} if tools else turns
    canonical = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
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
