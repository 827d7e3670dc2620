"""Every closed set is a ``str`` enum in common/choices.py, parsed at the edge and compared as
members after: no module of common/, workers/ or producer/ compares a string constant that is
one of those enums' values (==, !=, is, in a literal tuple/list/set, a match-case literal)."""

from __future__ import annotations

import ast
import inspect
import json
from enum import StrEnum
from pathlib import Path

import pytest

from common import choices
from common.config import load_settings
from common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "workers", "producer")

# Hits that are no closed set's value, each with why. Keep it short: every entry is a string
# comparison the check no longer sees.
ALLOWED: dict[tuple[str, str], str] = {
    # A device is an open set with a pattern (auto, cpu, cuda:N, mps: common.config.DEVICE).
    ("workers/devices.py", "auto"): "the device pattern's auto",
    # SGLang's platform is whatever its --device names (cuda, hip, xpu, npu, cpu, ...).
    ("common/runs/bench_verdict.py", "cpu"): "SGLang's platform, an open set",
    # A config.json's rope_type is transformers' to name (default, linear, yarn, ...).
    ("common/drafter/shape.py", "default"): "the target's rope_type, transformers' set",
    ("workers/train/drafter/config.py", "default"): "the target's rope_type, transformers' set",
    # A JSON key of run.json's drafter record, not a value.
    ("common/drafter/origin.py", "config"): "the record's config key",
}


def enum_values() -> dict[str, str]:
    """Each value of every str enum common/choices.py declares, with its enum's name."""
    values: dict[str, str] = {}
    for name, member in inspect.getmembers(choices, inspect.isclass):
        if issubclass(member, StrEnum) and member is not StrEnum \
                and member.__module__ == choices.__name__:
            values.update({item.value: name for item in member})
    return values


def _constants(node: ast.expr) -> list[str]:
    """The string constants a comparison's operand names: itself, or a literal collection's."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def compared_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, constant) of each string constant a comparison or a match-case tests against."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators, strict=True):
                # ``"key" in obj`` asks for a key (or a substring): only the tested side counts.
                sides = (right,) if isinstance(op, ast.In | ast.NotIn) else (left, right)
                found += [(node.lineno, text) for side in sides for text in _constants(side)]
                left = right
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, text) for text in _constants(node.value)]
    return found


def hits(values: dict[str, str]) -> list[str]:
    """``file:line`` of each comparison against an enum's value, not allowed above."""
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, text in compared_strings(ast.parse(path.read_text(), rel)):
                if text in values and (rel, text) not in ALLOWED:
                    out.append(f"{rel}:{line}: {text!r} is a value of {values[text]}")
    return out


def test_no_closed_set_value_is_compared_as_a_string() -> None:
    found = hits(enum_values())
    assert not found, "compare the enum's member, parsed at the edge:\n" + "\n".join(found)


def test_the_check_sees_every_kind_of_comparison() -> None:
    values = enum_values()
    assert {"ddp", "fsdp", "auto", "committed", "mt_bench", "NEXTN", "assistant", "hidden",
            "pause", "per-token", "kill", "local"} <= values.keys()
    source = ("a == 'fsdp'\nb != 'parked'\nc in ('ddp', 'x')\nd not in ['dolly']\n"
              "e is 'on'\nmatch f:\n    case 'NEXTN':\n        pass\ng == 'unrelated'\n"
              "'done' in record\n")
    found = [(line, text) for line, text in compared_strings(ast.parse(source))
             if text in values]
    assert found == [(1, "fsdp"), (2, "parked"), (3, "ddp"), (4, "dolly"), (5, "on"),
                     (7, "NEXTN")]


def test_every_allowed_hit_is_still_there() -> None:
    """A stale entry would let a new comparison of its value through unseen."""
    for (rel, text), _reason in ALLOWED.items():
        seen = {value for _, value in compared_strings(ast.parse((ROOT / rel).read_text()))}
        assert text in seen, f"{rel}: no comparison of {text!r} left: drop it from ALLOWED"


def test_members_keep_their_text_in_json() -> None:
    """run.json and ``--json`` keep their strings: a member serializes as its text."""
    import orjson

    record = {"parallel": choices.Parallel.FSDP, "state": choices.ShardState.PARKED,
              "format": choices.InputFormat.MT_BENCH}
    assert json.dumps(record) == json.dumps({k: str(v) for k, v in record.items()})
    assert orjson.loads(orjson.dumps(record)) == {"parallel": "fsdp", "state": "parked",
                                                  "format": "mt_bench"}


def test_a_bad_parallel_variable_is_refused_naming_it() -> None:
    assert load_settings({"DFLASH_TRAIN_PARALLEL": "fsdp"}).train.parallel \
        is choices.Parallel.FSDP
    with pytest.raises(ConfigError, match="DFLASH_TRAIN_PARALLEL='zero3' is not one of ddp, fsdp"):
        load_settings({"DFLASH_TRAIN_PARALLEL": "zero3"})
