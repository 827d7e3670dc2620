"""The standard speculative-decoding sets for ``eval-drafter --dataset``: readers and prompts.

    spec = parse_dataset("gsm8k=/data/gsm8k/main")     # NAME=PATH, NAME (hub) or a prompt file
    texts = set_prompts(spec, num=128)                  # [SetPrompt(id, text)] in file order
    ids = encode_prompt(tokenizer, [{"role": "user", "content": texts[0].text}], thinking=False)

Each set is read in the layout its own repository publishes (a JSONL or Parquet file, or a
directory of them) and its user turn is built as z-lab's ``dflash/benchmark.py`` builds it, the
harness of the published DFlash figures (mt-bench: the first turn, as its server path sends).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError, InputError
from common.inputs.readers import SUPPORTED_EXTENSIONS, iter_records

log = logging.getLogger(__name__)

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE = "Write a solution to the following problem and make sure that it passes the tests:\n"


def _text(row: Mapping[str, Any], *fields: str) -> str:
    for name in fields:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value
    raise ValueError(f"no text in {' or '.join(repr(f) for f in fields)}")


def _mt_bench(row: Mapping[str, Any]) -> str:
    turns = row.get("turns", row.get("prompt"))   # FastChat's `turns`, the hub copy's `prompt`
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise ValueError("no 'turns' (or 'prompt') list of strings")
    return turns[0]


@dataclass(frozen=True)
class StandardSet:
    """One published set: its hub id, the fields a row must have, how its user turn is built."""

    hub: tuple[str, ...]              # load_dataset's positional arguments
    split: str
    id_fields: tuple[str, ...]
    build: Callable[[Mapping[str, Any]], str]


SETS: dict[str, StandardSet] = {
    "gsm8k": StandardSet(("openai/gsm8k", "main"), "test", (),
                         lambda r: _text(r, "question") + REASON),
    "math500": StandardSet(("HuggingFaceH4/MATH-500",), "test", ("unique_id",),
                           lambda r: _text(r, "problem") + REASON),
    "humaneval": StandardSet(("openai/openai_humaneval",), "test", ("task_id",),
                             lambda r: f"{CODE}```python\n{_text(r, 'prompt')}\n```"),
    # The sanitized split's `prompt`, the full split's `text` (z-lab sends the text alone).
    "mbpp": StandardSet(("google-research-datasets/mbpp", "sanitized"), "test", ("task_id",),
                        lambda r: _text(r, "prompt", "text")),
    "mt-bench": StandardSet(("HuggingFaceH4/mt_bench_prompts",), "train",
                            ("question_id", "prompt_id"), _mt_bench),
}


@dataclass(frozen=True)
class DatasetSpec:
    """What one ``--dataset`` names: a standard set (``kind`` its name) or any prompt file."""

    name: str
    kind: str | None          # a key of SETS, or None for a prompt file enqueue reads
    path: str | None          # None: fetch the standard set from the hub


@dataclass(frozen=True)
class SetPrompt:
    """One prompt of a set: its id and the user turn's text."""

    id: str
    text: str


def parse_dataset(value: str) -> DatasetSpec:
    """``NAME=PATH``, ``NAME`` (a standard set, from the hub) or ``PATH`` (named by its stem)."""
    name, sep, path = value.partition("=")
    if sep:
        if name not in SETS:
            raise ConfigError(f"--dataset {value}: unknown set {name!r}; the standard sets are "
                              f"{', '.join(SETS)} (any prompt file: --dataset PATH)")
        if not path:
            raise ConfigError(f"--dataset {value}: no path after '='")
        return DatasetSpec(name, name, path)
    if value in SETS:
        return DatasetSpec(value, value, None)
    if os.path.exists(value) or value.startswith("s3://"):
        return DatasetSpec(_stem(value), None, value)
    raise ConfigError(f"--dataset {value}: neither a standard set ({', '.join(SETS)}) nor an "
                      "existing prompt file")


def parse_datasets(values: Iterable[str]) -> list[DatasetSpec]:
    """Every ``--dataset``, each set named once: two of one name would share one table row."""
    specs = [parse_dataset(value) for value in values]
    names = [spec.name for spec in specs]
    odd = next((n for n in names if not n or len(n) > 200 or not n.isprintable()), None)
    if odd is not None:   # the stored table names each set on one line of the report
        raise ConfigError(f"--dataset: the set name {odd[:60]!r} (a prompt file's stem) is "
                          "empty, over 200 characters or not printable: rename the file")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"--dataset: {', '.join(map(repr, twice))} named more than once (a "
                          "prompt file is named by its stem: rename one)")
    return specs


def _stem(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    for suffix in sorted(SUPPORTED_EXTENSIONS, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[:-len(suffix)]
    return name


def _files(path: Path, split: str, config: str | None = None) -> list[Path]:
    """A file, or a directory's readable files: those of the set's split when any is named so,
    under its hub config's folder where the copy has one (gsm8k's ``main/`` beside
    ``socratic/``, mbpp's ``sanitized/`` beside ``full/``: never two configs' rows as one set)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise InputError(f"{path}: no such file or directory")
    if config and (path / config).is_dir():
        path = path / config
    found = sorted(p for p in path.rglob("*") if p.is_file()
                   and p.name.lower().endswith(SUPPORTED_EXTENSIONS))
    of_split = [p for p in found if split in str(p.relative_to(path)).lower()]
    if not (of_split or found):
        raise InputError(f"{path}: no JSONL or Parquet file in it")
    return of_split or found


def _rows(files: list[Path]) -> Iterator[tuple[str, Any]]:
    for file in files:
        for record in iter_records(file):
            yield f"{file}:{record.line}", record.data if record.error is None else record.error


def read_set(kind: str, path: str, num: int) -> list[SetPrompt]:
    """Up to ``num`` prompts of standard set ``kind`` from a local copy, in file order.

    A row that is not the set's layout is an InputError naming the file, line and field."""
    spec = SETS[kind]
    prompts: list[SetPrompt] = []
    config = spec.hub[1] if len(spec.hub) > 1 else None
    for where, row in _rows(_files(Path(path), spec.split, config)):
        if len(prompts) >= num:
            break
        if not isinstance(row, dict):
            raise InputError(f"{where}: not a {kind} row ({str(row)[:120]})")
        try:
            text = spec.build(row)
        except ValueError as exc:
            raise InputError(f"{where}: not a {kind} row: {exc} (the layout of "
                             f"{spec.hub[0]}; pass the set's own file)") from None
        ident = next((str(row[f]) for f in spec.id_fields if row.get(f) is not None),
                     f"{kind}-{len(prompts)}")
        prompts.append(SetPrompt(ident, text))
    if not prompts:
        raise InputError(f"{path}: no {kind} row in it")
    log.info("dataset %s: %d prompts from %s", kind, len(prompts), path)
    return prompts


def fetch_set(kind: str, cache_dir: Path) -> str:
    """The set from the Hugging Face hub, as a JSONL file under ``cache_dir`` (written once).

    A ConfigError naming ``--dataset NAME=PATH`` where ``datasets`` or the hub is not there."""
    spec = SETS[kind]
    out = cache_dir / "eval-sets" / f"{kind}.jsonl"
    if out.is_file():
        return str(out)
    fix = (f"download {spec.hub[0]} elsewhere and pass --dataset {kind}=PATH (its JSONL or "
           "Parquet file, or the directory)")
    try:
        from datasets import load_dataset  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise ConfigError(f"--dataset {kind}: fetching needs the `datasets` package; {fix}"
                          ) from None
    try:
        rows = load_dataset(*spec.hub, split=spec.split)
    except Exception as exc:   # any hub or network failure: one line, with the way around it
        raise ConfigError(f"--dataset {kind}: {spec.hub[0]} could not be fetched "
                          f"({type(exc).__name__}: {str(exc)[:200]}); {fix}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    rows.to_json(str(out.with_suffix(".tmp")), lines=True)
    out.with_suffix(".tmp").replace(out)
    return str(out)
