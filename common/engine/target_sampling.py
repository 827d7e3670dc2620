"""The sampling a run uses: each value from its flag, else the target's own
``generation_config.json`` (its publisher's recommendation), else the project's default.

    values, sources = resolve_sampling(model_dir, {"temperature": None, "top_p": 0.8, ...})
    # sources: {"temperature": "generation_config.json", "top_p": "flag", "min_p": "default"}

A ``generation_config.json`` that says ``do_sample: false`` asks for greedy decoding: its
temperature is 0 unless a flag says otherwise.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from common.engine.sampling import MAX_NEW_TOKENS_CAP, Sampling

log = logging.getLogger(__name__)

# The values a target's generation_config.json may recommend, under the same names.
FROM_TARGET = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "presence_penalty")
FLAG, TARGET, DEFAULT = "flag", "generation_config.json", "default"
CONTEXT = "target context"


def generation_config(model_dir: Path) -> dict[str, Any]:
    """The target's generation_config.json (empty when it has none or it cannot be read)."""
    path = model_dir / "generation_config.json"
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        log.warning("%s not read (%s): the project's sampling defaults apply", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def resolve_sampling(model_dir: Path, given: dict[str, Any]) -> tuple[dict[str, Any],
                                                                      dict[str, str]]:
    """Every value of :data:`FROM_TARGET`: given (not None), else the target's, else default."""
    target = generation_config(model_dir)
    if target.get("do_sample") is False:
        target = {**target, "temperature": 0.0}
    defaults: dict[str, Any] = {f.name: f.default for f in fields(Sampling)}
    values, sources = {}, {}
    for name in FROM_TARGET:
        if given.get(name) is not None:
            values[name], sources[name] = given[name], FLAG
        elif isinstance(target.get(name), int | float) and not isinstance(target[name], bool):
            values[name], sources[name] = type(defaults[name])(target[name]), TARGET
        else:
            values[name], sources[name] = defaults[name], DEFAULT
    return values, sources


def resolve_max_new_tokens(given: int | None, context: int | None) -> tuple[int, str]:
    """The per-turn budget: the flag, else what the target's context allows (at most
    :data:`MAX_NEW_TOKENS_CAP`), else the cap when the target states no context."""
    if given is not None:
        return given, FLAG
    if context:
        return min(MAX_NEW_TOKENS_CAP, context), CONTEXT
    return MAX_NEW_TOKENS_CAP, DEFAULT


def sampling_line(in_force: dict[str, dict[str, Any]]) -> str:
    """One line for people: each sampling value in force and where it came from."""
    return "sampling: " + ", ".join(f"{name} {entry['value']} ({entry['source']})"
                                    for name, entry in in_force.items())
