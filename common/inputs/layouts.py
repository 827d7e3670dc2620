"""Row layouts: turn one raw input row into the conversations the target model will answer.

``--format auto`` (the default) detects the layout of each row from its keys, in this order:

==============  ==========================================================  ===================
layout          row                                                         prompt
==============  ==========================================================  ===================
``messages``    ``{"messages": [{"role", "content"}, ...]}`` (OpenAI)        the user turns
``sharegpt``    ``{"conversations": [{"from", "value"}, ...]}``, also with   the user turns
                ``role``/``content`` keys as SpecForge writes it
``mt_bench``    ``{"turns": ["q1", "q2"]}``                                  one turn each
``ultrachat``   ``{"data": ["q1", "a1", "q2", ...]}`` (alternating)          the even entries
``instances``   ``{"instruction", "instances": [{"input", "output"}]}``      one conversation
                (self-instruct seed tasks)                                   per instance
``dolly``       ``{"instruction", "context"}``                               instruction +
                                                                            blank line + context
``alpaca``      ``{"instruction", "input"}``                                 instruction +
                                                                            blank line + input
``prompt``      one of ``prompt``, ``instruction``, ``question``, ``input``,  that field
                ``text`` (or ``--prompt-field``)
==============  ==========================================================  ===================

Fields beside the turns add to them (``common.inputs.extras``): ``system``, ``tools`` and
``history``. ``--prompt-template`` (a format string over the row's fields, e.g.
``"{instruction}\\n\\n{context}"``) replaces the detection. A field with text of any type
(``common.inputs.fields``) that the layout does not use (other than reference answers such as
``output``/``response``/``answer`` and plain metadata such as ``category``) is reported; with
``strict`` the row is rejected instead, so no prompt text is ever dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.choices import InputFormat, Role, RowLayout
from common.errors import BadRow, ConfigError
from common.inputs.extras import history_turns, nonempty, user_turn, with_system
from common.inputs.fields import has_text, match_case, unused_fields
from common.inputs.rows import (
    ANSWER_FIELDS,
    ID_FIELDS,
    OPENAI_ROLES,
    SHAREGPT_ROLES,
    Conversation,
    content_id,
    group_turns,
    parse_messages,
    sample_id,
)
from common.inputs.templates import from_template, template_fields
from common.inputs.text import check_text, jsonable, type_name
from common.inputs.tools import normalize_tools

FORMATS = tuple(member.value for member in InputFormat)
PROMPT_FIELDS = ("prompt", "instruction", "question", "input", "text")
_CONVERSATION_KEYS = {RowLayout.MESSAGES: "messages", RowLayout.SHAREGPT: "conversations",
                      RowLayout.MT_BENCH: "turns", RowLayout.ULTRACHAT: "data",
                      RowLayout.INSTANCES: "instances"}
# Layouts detected only where their field is a list (a string of UltraChat's is one prompt).
_LIST_ONLY = (RowLayout.ULTRACHAT, RowLayout.INSTANCES)
# Field names matched case-insensitively when the exact one is absent.
KNOWN_FIELDS = (*_CONVERSATION_KEYS.values(), *PROMPT_FIELDS, "context", "system", "history",
                *ID_FIELDS)

Turns = list[list[dict[str, Any]]]


@dataclass(frozen=True)
class Normalized:
    """What one input row became: its conversations (several for ``instances``), its layout,
    and the text fields it had that no prompt uses."""

    conversations: list[Conversation]
    layout: RowLayout
    unused: tuple[str, ...] = field(default=())
    matched: tuple[tuple[str, str], ...] = field(default=())  # (field found, name it matched)


def detect_layout(data: dict[str, Any], prompt_field: str | None) -> RowLayout:
    """Pick the layout of one object row from its keys, or raise BadRow listing them."""
    # Parquet and Arrow rows carry every column of the file: a None value is an absent field.
    for layout, key in _CONVERSATION_KEYS.items():
        value = data.get(key)
        if value is None or (layout in _LIST_ONLY and not isinstance(value, list)):
            continue
        if layout is not RowLayout.INSTANCES or data.get("instruction") is not None:
            return layout
    if data.get("instruction") is not None and prompt_field is None:
        return RowLayout.DOLLY if data.get("context") not in (None, "") else RowLayout.ALPACA
    if (prompt_field is not None and data.get(prompt_field) is not None) or any(
            data.get(name) is not None for name in PROMPT_FIELDS):
        return RowLayout.PROMPT
    keys = ", ".join(sorted(str(k) for k, v in data.items() if v is not None)) or "none"
    if isinstance(data.get("data"), str):
        raise not_a_list("data", "alternating user and assistant strings")
    raise BadRow("cannot detect the row format: no messages, conversations, turns, data, "
                 f"instruction or prompt field (found keys: {keys})")


def _joined(data: dict[str, Any], first: str, second: str) -> str:
    """``first``, a blank line, then ``second`` when the row has a non-empty one."""
    text = nonempty(data.get(first), first)
    extra = data.get(second)
    if extra is not None and check_text(extra, second).strip():
        text = f"{text}\n\n{extra}"
    return text


def not_a_list(name: str, what: str) -> BadRow:
    """The reason for a string where a list of turns belongs (UltraChat's ``data`` as text)."""
    return BadRow(f"{name} is a string, expected a list of turns ({what}); use --prompt-field "
                  f"{name} to read it as one prompt")


def mt_bench_turns(data: dict[str, Any]) -> Turns:
    questions = data["turns"]
    if isinstance(questions, str):
        raise not_a_list("turns", "the user questions")
    if not isinstance(questions, list):
        raise BadRow(f"turns must be a list, got {type_name(questions)}")
    turns = []
    for index, question in enumerate(questions):
        text = check_text(question, f"turns[{index}]")
        if not text.strip():
            raise BadRow(f"empty user message at turns[{index}]")
        turns.append([{"role": "user", "content": text}])
    if not turns:
        raise BadRow("no user message")
    return turns


def ultrachat_turns(data: dict[str, Any]) -> Turns:
    """Alternating user/assistant strings; the assistant ones are regenerated."""
    items = data["data"]
    if isinstance(items, str):
        raise not_a_list("data", "alternating user and assistant strings")
    roles = [(Role.USER if i % 2 == 0 else Role.ASSISTANT, check_text(v, f"data[{i}]"))
             for i, v in enumerate(items)]
    for index, (role, text) in enumerate(roles):
        if role is Role.USER and not text.strip():
            raise BadRow(f"empty user message at data[{index}]")
    return group_turns(roles)


def prompt_field_of(data: dict[str, Any], prompt_field: str | None) -> str:
    if prompt_field is not None:
        if data.get(prompt_field) is None:
            raise BadRow(f"no prompt field {prompt_field!r} "
                         f"(found keys: {', '.join(map(str, data))})")
        return prompt_field
    found = next((name for name in PROMPT_FIELDS if data.get(name) is not None), None)
    if found is None:
        raise BadRow(f"no prompt field: expected one of {', '.join(PROMPT_FIELDS)}")
    return found


def _turns(data: dict[str, Any], layout: RowLayout,
           prompt_field: str | None) -> tuple[list[Turns], set[str]]:
    """The conversations of a row in ``layout`` and the fields they used."""
    if layout is RowLayout.MESSAGES:
        pairs = parse_messages(data, "messages", ("role",), ("content",), OPENAI_ROLES)
        return [group_turns(pairs)], {"messages"}
    if layout is RowLayout.SHAREGPT:
        pairs = parse_messages(data, "conversations", ("from", "role"), ("value", "content"),
                               SHAREGPT_ROLES)
        return [group_turns(pairs)], {"conversations"}
    if layout is RowLayout.MT_BENCH:
        return [mt_bench_turns(data)], {"turns"}
    if layout is RowLayout.ULTRACHAT:
        return [ultrachat_turns(data)], {"data"}
    if layout is RowLayout.INSTANCES:
        return _instances(data), {"instruction", "instances"}
    earlier, used = history_turns(data), {"history"}
    if layout is RowLayout.DOLLY:
        return [earlier + user_turn(_joined(data, "instruction", "context"))], {
            "instruction", "context", *used}
    if layout is RowLayout.ALPACA or (layout is RowLayout.PROMPT and prompt_field is None
                                      and prompt_field_of(data, None) == "instruction"):
        return [earlier + user_turn(_joined(data, "instruction", "input"))], {
            "instruction", "input", *used}
    name = prompt_field_of(data, prompt_field)
    return [earlier + user_turn(nonempty(data[name], name))], {name, *used}


def _instances(data: dict[str, Any]) -> list[Turns]:
    instruction = nonempty(data.get("instruction"), "instruction")
    items = data["instances"]
    if not isinstance(items, list) or not items:
        raise BadRow("instances must be a non-empty list")
    conversations = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRow(f"instances[{index}] must be an object, got {type_name(item)}")
        extra = item.get("input")
        text = instruction
        if extra is not None and check_text(extra, f"instances[{index}].input").strip():
            text = f"{instruction}\n\n{extra}"
        conversations.append(user_turn(text))
    return conversations


def normalize_row(data: object, fmt: str = InputFormat.AUTO, prompt_field: str | None = None,
                  template: str | None = None, strict: bool = False) -> Normalized:
    """Validate one raw row and return its conversations, or raise BadRow with the reason;
    ``fmt`` a member, or its text (a caller's own, checked here)."""
    try:
        fixed = InputFormat(fmt).layout()
    except ValueError:
        raise ConfigError(f"unknown input format {fmt!r}; expected one of "
                          f"{', '.join(FORMATS)}") from None
    if not isinstance(data, dict):
        raise BadRow(f"row is {'null' if data is None else 'a ' + type_name(data)}, expected "
                     "an object")
    matched: tuple[tuple[str, str], ...] = ()
    if template is not None:
        layout, used = RowLayout.TEMPLATE, template_fields(template) | {"history"}
        prompt = nonempty(from_template(data, template), "--prompt-template")
        many = [history_turns(data) + user_turn(prompt)]
    else:
        data, matched = match_case(data, (*KNOWN_FIELDS, *([prompt_field] if prompt_field
                                                           else ())))
        layout = fixed or detect_layout(data, prompt_field)
        key = _CONVERSATION_KEYS.get(layout)
        if key is not None and data.get(key) is None:
            raise BadRow(f"missing field {key!r} for format {layout}")
        many, used = _turns(data, layout, prompt_field)
    if all([with_system(turns, data) for turns in many]):
        used = used | {"system"}
    tools = None
    if has_text(data.get("tools")):
        tools = normalize_tools(data["tools"])
        used = used | {"tools"}
    unused = unused_fields(data, used)
    if unused and strict:
        raise BadRow(f"text field(s) {', '.join(unused)} would be dropped: the {layout} layout "
                     "does not put them in the prompt (use --prompt-template, or leave out "
                     "--strict-fields)")
    found_id, id_field, original = sample_id(data)
    skip = used | ANSWER_FIELDS | {"id", id_field}
    source = jsonable({"id": original, **{k: v for k, v in data.items()
                                          if k not in skip and v is not None}})
    conversations = []
    for index, turns in enumerate(many):
        if len(many) == 1:
            conversations.append(Conversation(found_id or content_id(turns, tools), turns,
                                              source, tools))
        else:
            own = f"{found_id}#{index}" if found_id else content_id(turns, tools)
            conversations.append(Conversation(own, turns, {**source, "instance": index}, tools))
    return Normalized(conversations, layout, unused, matched)
