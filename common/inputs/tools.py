"""Tools are data, never text we write: every layout's tool definitions, calls and results in
the OpenAI structure that chat templates take (the target's template renders them).

    tool_call_message(item, content, where)   # {"role": "assistant", "tool_calls": [...]}
    tool_result_message(item, content, where, "content")   # {"role": "tool", ...}
    normalize_tools(row["tools"])              # [{"type": "function", "function": {...}}]
"""

from __future__ import annotations

import json
from typing import Any

from common.choices import Role
from common.errors import BadRow
from common.inputs.text import check_text, jsonable, type_name


def _tool_text(value: object, where: str) -> str:
    """A tool result's text: a string as is, structured results as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return check_text(value, where)
    return json.dumps(value, ensure_ascii=False)


def tool_result_message(item: dict[str, Any], content: object, where: str,
                        content_key: str) -> dict[str, Any]:
    """A ``role: tool`` message: its text, and the call id and name when the row gives them."""
    message = {"role": "tool", "content": _tool_text(content, f"{where}.{content_key}")}
    for key in ("tool_call_id", "name"):
        if isinstance(item.get(key), str):
            message[key] = check_text(item[key], f"{where}.{key}")
    return message


def _arguments(value: object, where: str) -> dict[str, Any]:
    """A call's arguments as an object (templates iterate them); JSON text is parsed."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise BadRow(f"{where}.arguments is not JSON: {str(value)[:80]!r}") from None
    if not isinstance(value, dict):
        raise BadRow(f"{where}.arguments must be an object, got {type_name(value)}")
    return value


def _call(call: object, where: str) -> dict[str, Any]:
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


def tool_call_message(item: dict[str, Any], content: object, where: str) -> dict[str, Any]:
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


def normalize_tools(tools: object) -> list[dict[str, Any]]:
    """A row's tool definitions (a list, one object, or their JSON text) in the OpenAI
    structure ``[{"type": "function", "function": {"name", ...}}]``."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise BadRow(f"tools is not JSON: {str(tools)[:80]!r}") from None
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


def uses_tools(row: dict[str, Any]) -> bool:
    """A row whose rendering needs the template's tool branches."""
    return bool(row.get("tools")) or any(
        m["role"] == Role.TOOL or m.get("tool_calls") for group in row["turns"] for m in group)
