"""run.json's JSON Schema, generated from the record (:class:`common.runs.records.RunConfig`) and
the run options' declarations (:mod:`common.runs.options`): a field an option fills carries that
option's help; nested records (sampling, gates, the drafter's origin) are described the same
way. The docs' record reference prints it and a test validates a real run.json against it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any

from common.declared import declared
from common.runs.options import RunOptions
from common.runs.records import RunConfig
from common.runs.schema import RUN_SCHEMA

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
_FROM_OPTIONS = {  # run.json fields an option fills under another name or resolved
    "sampling": "the options max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, "
                "presence_penalty, thinking",
    "gates": "the options min_supervised_tokens, max_reject_rate, pause_after, min_answer_tokens, "
             "skip_gate",
    "model": "--model (the model setting, DFLASH_MODEL)",
    "target_layer_ids": "the option target_layers, resolved for the target",
    "drafter": "the options drafter_config, init_drafter, drafter_layers",
}


def _type_schema(hint: Any) -> dict[str, Any]:
    """A JSON Schema for a Python type hint of a record field."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(arg) for arg in typing.get_args(hint)]}
    if hint is type(None):
        return {"type": "null"}
    if isinstance(hint, type) and issubclass(hint, Enum):
        return {"enum": [member.value for member in hint]}
    if hint in _SCALARS:
        number = {"type": ["integer", "number"]} if hint is float else {}
        return number or {"type": _SCALARS[hint]}
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return {"type": "array", **({"items": _type_schema(args[0])} if args else {})}
    if origin is dict or hint is dict:
        return {"type": "object"}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return record_schema(hint)
    return {}


def record_schema(record: type, complete: bool = False) -> dict[str, Any]:
    """An object schema of a record's fields; ``complete``: every field is written (asdict),
    else those without a default."""
    hints = typing.get_type_hints(record)
    found = [f for f in dataclasses.fields(record) if not f.name.startswith("_")]
    props = {f.name: _type_schema(hints[f.name]) for f in found}
    required = [f.name for f in found if complete or (
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)]
    return {"type": "object", "description": (record.__doc__ or "").split("\n")[0],
            "properties": props, "required": sorted(required)}


def run_json_schema() -> dict[str, Any]:
    """run.json's schema: each field's type, and the help of the option that fills it."""
    schema = record_schema(RunConfig, complete=True)
    helps = {f.name: found.help for f in dataclasses.fields(RunOptions)
             if (found := declared(f)) is not None}
    for name, prop in schema["properties"].items():
        if name in helps:
            prop["description"] = f"--{name.replace('_', '-')}: {helps[name]}"
        elif name in _FROM_OPTIONS:
            prop["description"] = f"from {_FROM_OPTIONS[name]}"
    schema["properties"]["schema"] = {"const": RUN_SCHEMA,
                                      "description": "run.json's schema number"}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "runs/<run>/run.json", **schema}
