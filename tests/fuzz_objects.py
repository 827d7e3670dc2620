"""Objects no reader should take for a record, at every key a role of the stack may write: the
generator of tests/test_fuzz_layout.py.

    for forged in forgeries(random.Random(seed), run, templates, batch):
        forged.role, forged.key, forged.body, forged.overwrite   # put with that role's key

The cases are derived, not chosen: :func:`layouts` gives one or more keys for every kind of the
storage layout (``common.key_layout.KeyKind``; a kind without one fails
``test_every_layout_kind_is_fuzzed``), each key is written by every role whose policy file
(``docs/policies/<role>.json``, AWS's evaluation logic of tests/test_policies.py) lets it write
there, and each gets every body family of its object's format (:func:`bodies`): the wrong type
at one field of a real record, JSON of another type, not JSON, an empty body, deep nesting with a
lone surrogate, NaN, many small rows under the decompressed cap, a zstd frame that states a size
past the cap (a bomb), truncated zstd, a frame that hides its size, a pickle where a tensor file
goes, a safetensors header bomb. A key of a kind whose objects a writer replaces (the index, the
gate, bench and eval records, ``latest.json``, parking records) is also written over an existing
object, where the store allows it (MinIO: everywhere; AWS: ``latest.json`` only). A
well-formed record a role may legitimately write is its stage's own output, not in scope.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import zstandard

from common import keys
from common.key_layout import KeyKind
from tests.test_policies import POLICIES, decide, fill

BOMB_BYTES = 2 * 2**30   # what the bomb decompresses to: a reader that inflates it is gone
MANY_ROWS = 4_000_000    # {"id":"x"} rows: ~3.6 KiB of zstd, 44 MB decoded (under the caps)
DEEP = 50_000            # nesting of the deep body: past any recursive parser's limit
WRONG = ("a string", -1, 10**18, 1.5, None, True, [0], {"x": 1})
ROLES = ("producer", "generate", "hidden", "train", "reconciler", "reader", "export-s3")
PWNED = "/tmp/dflash-fuzz-pwned"   # the pickle's payload makes this directory if ever loaded


class Family(StrEnum):
    """An object's format, which decides its body families."""

    JSON = "json"
    JSONL = "jsonl"
    JSONL_ZST = "jsonl.zst"
    JSON_ZST = "json.zst"
    SAFETENSORS = "safetensors"
    TORCH = "torch"
    BYTES = "bytes"


@dataclass(frozen=True)
class Layout:
    """One key of the layout as the fuzz writes it: ``key(run, n)`` (n: a number no honest
    writer takes), its format, the real record its bodies take apart, replaced by its writer."""

    kind: KeyKind
    key: Callable[[str, int], str]
    family: Family
    template: str
    replaced: bool = False


@dataclass(frozen=True)
class Forged:
    role: str
    key: str
    body: bytes
    what: str
    overwrite: bool = False


# A real eval record's shape (common.runs.evals), for the bodies to take apart: the run under
# test has none of its own (eval-drafter --dataset is not part of its stack).
EVAL = {"run": "fz", "stamp": "20260101T000000.000000-abcdef", "engine": "sglang",
        "drafter": {"step": 2, "name": None}, "thinking": "off", "sets": ["gsm8k"],
        "max_new_tokens": 64, "definition": {"tau": "ours"}, "datasets": {"gsm8k": {
            "prompts": 2, "tokens": 10, "tau": 2.5, "tau_pooled": 2.5,
            "spec_accept_length": 3.0, "by_position": {"0-1k": 2.5, "16k+": None},
            "lossless": {"checked": 2, "mismatches": []}, "tokens_per_s": 1.5,
            "speedup": 1.2, "concurrency": {"1": {
                "tokens": 10, "tokens_per_s": 1.5, "spec_accept_length": 3.0,
                "baseline_tokens_per_s": 1.25, "speedup": 1.2}}}}}
DEFAULT_TEMPLATES = {"eval": EVAL}
LATER_KINDS = {KeyKind.EVAL}   # added after REGRESSIONS: drawn from a stream of their own


def _stamp(n: int) -> str:
    return f"00000000T000000.{n:06d}-000000"   # sorts before every real stamp


def layouts(index_count: int) -> list[Layout]:
    """Every kind of the layout, at keys a reader meets: past the last shard or step, in a real
    shard beside its real parts, tags and stamps that list first."""
    past = 100000
    L, F = Layout, Family
    return [
        L(KeyKind.RUN_CONFIG, lambda r, n: keys.run_config(f"{r}-f{n}"), F.JSON, "run"),
        L(KeyKind.INPUT, lambda r, n: keys.input_shard(r, past + n), F.JSONL_ZST, "input_row"),
        L(KeyKind.MANIFEST, lambda r, n: keys.inputs_manifest(r), F.JSON, "manifest"),
        L(KeyKind.INPUT_ROWS, lambda r, n: keys.rejected_input_rows(r, 5000 + n), F.JSONL,
          "input_row"),
        L(KeyKind.PART, lambda r, n: keys.generated_part(r, 0, 5000 + n), F.JSONL_ZST,
          "sample"),
        L(KeyKind.PART, lambda r, n: keys.generated_part(r, past + n, 0), F.JSONL_ZST,
          "sample"),
        L(KeyKind.PART, lambda r, n: keys.rejected_part(r, 1, 5000 + n), F.JSONL_ZST, "sample"),
        L(KeyKind.PART, lambda r, n: keys.hidden_part(r, 0, 5000 + n), F.SAFETENSORS, "tensor"),
        L(KeyKind.PART, lambda r, n: keys.hidden_part(r, past + n, 0), F.SAFETENSORS, "tensor"),
        L(KeyKind.COMMIT, lambda r, n: keys.generated_commit(r, past + n), F.JSON, "commit"),
        L(KeyKind.COMMIT, lambda r, n: keys.hidden_commit(r, past + n), F.JSON, "commit"),
        L(KeyKind.COMMIT, lambda r, n: keys.hidden_commit(r, n % 2), F.JSON, "commit"),
        L(KeyKind.HIDDEN_INDEX, lambda r, n: keys.hidden_index(r, past + n), F.JSON, "commit"),
        L(KeyKind.FAILED, lambda r, n: keys.failed_shard(r, 0, _stamp(n)), F.JSON, "failed",
          True),
        L(KeyKind.FAILED, lambda r, n: keys.failed_shard(r, past + n, _stamp(n), "hidden"),
          F.JSON, "failed", True),
        L(KeyKind.FAILED, lambda r, n: keys.failed_shard(r, 1, _stamp(n), "train"), F.JSON,
          "failed", True),
        L(KeyKind.GATE, lambda r, n: keys.gate_event(r, "pause", _stamp(n)), F.JSON, "pause",
          True),
        L(KeyKind.GATE, lambda r, n: keys.gate_event(r, "resume", _stamp(n)), F.JSON, "resume",
          True),
        L(KeyKind.REPORT, lambda r, n: keys.report_png(r, _stamp(n)), F.BYTES, "none", True),
        L(KeyKind.CHECKPOINT, lambda r, n: keys.drafter_checkpoint(r, 900000 + n, "state.pt"),
          F.TORCH, "none"),
        L(KeyKind.CHECKPOINT, lambda r, n: keys.drafter_checkpoint(r, 900000 + n,
                                                                   "_COMMIT.json"),
          F.JSON, "checkpoint"),
        L(KeyKind.CHECKPOINT, lambda r, n: keys.drafter_checkpoint(r, 900000 + n,
                                                                   "_COMMIT.json", 1),
          F.JSON, "checkpoint"),
        L(KeyKind.LATEST, lambda r, n: keys.drafter_latest(r), F.JSON, "latest", True),
        *[L(KeyKind.INDEX, lambda r, n, kind=kind: keys.index_object(
            r, kind, 0, index_count, f"{n:08x}"), F.JSON_ZST, "index", True)
          for kind in ("commits", "digests", "summaries")],
        L(KeyKind.PROBE, lambda r, n: keys.access_probe("generated"), F.BYTES, "none", True),
        L(KeyKind.BENCH, lambda r, n: keys.bench_verdict(r, "unknown-tp1-0123abcd", _stamp(n)),
          F.JSON, "bench", True),
        L(KeyKind.EVAL, lambda r, n: keys.eval_record(r, _stamp(n)), F.JSON, "eval", True),
    ]


ALMOST = (   # keys a digit or a character away from a template: no reader takes them
    ("generate", "runs/{run}/generated/shard-0{n:04d}/_COMMIT.json", Family.JSON, "commit"),
    ("train", "runs/{run}/drafter/step-{n:06d}0/_COMMIT.json", Family.JSON, "checkpoint"),
    ("reconciler", "runs/{run}/index/commits/chunk-0000-{count:03d}-{n:08x}g.json.zst",
     Family.JSON_ZST, "index"),
)


def writers(key: str) -> list[str]:
    """The roles whose policy file lets them put ``key`` (AWS's evaluation, a storage prefix)."""
    found = []
    for role in ROLES:
        policy = [fill(POLICIES / f"{role}.json", "data/")]
        if decide(policy, "s3:PutObject", f"arn:aws:s3:::my-bucket/data/{key}"):
            found.append(role)
    return found


def _zst(data: bytes, size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=size).compress(data)


_BOMB: bytes | None = None


def bomb() -> bytes:
    """~64 KiB of zstd that decompresses to :data:`BOMB_BYTES` (its frame states the size)."""
    global _BOMB
    if _BOMB is None:
        writer = zstandard.ZstdCompressor(level=19).compressobj(size=BOMB_BYTES)
        zero = b"\0" * 2**24
        _BOMB = b"".join(writer.compress(zero) for _ in range(BOMB_BYTES // len(zero))) \
            + writer.flush()
    return _BOMB


@functools.cache
def _many_rows(zst: bool) -> bytes:
    """:data:`MANY_ROWS` tiny rows, zstd-compressed (~3.6 KiB); plain JSONL: a 40th of them."""
    many = b'{"id":"x"}\n' * (MANY_ROWS if zst else MANY_ROWS // 40)
    return _zst(many) if zst else many


def mutated(rng: random.Random, record: Any, value: Any = None) -> tuple[Any, str]:
    """``record`` with one field (at any depth) given a wrong value (``value``, or one of the
    wrong type or range)."""
    record = copy.deepcopy(record)
    paths: list[list[Any]] = []

    def walk(item: Any, path: list[Any]) -> None:
        if isinstance(item, dict):
            for k, v in item.items():
                paths.append([*path, k])
                walk(v, [*path, k])
        elif isinstance(item, list) and item:
            paths.append([*path, 0])
            walk(item[0], [*path, 0])

    walk(record, [])
    if not paths:
        return (value if value is not None else rng.choice(WRONG)), "not an object"
    path = rng.choice(paths)
    parent = record
    for step in path[:-1]:
        parent = parent[step]
    wrong = value if value is not None else rng.choice(
        [w for w in WRONG if type(w) is not type(parent[path[-1]])])
    parent[path[-1]] = wrong
    return record, f"{'.'.join(map(str, path))} = {wrong!r}"


def _json_values(rng: random.Random, template: Any) -> Iterator[tuple[bytes, str]]:
    """The JSON texts that are no valid record like ``template``."""
    record, what = mutated(rng, template)
    yield json.dumps(record).encode(), f"wrong type: {what}"
    yield json.dumps(rng.choice(WRONG)).encode(), "JSON of another type"
    deep = b'{"s": "\\ud800", "a": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    yield deep, "deep nesting with a lone surrogate"
    record, what = mutated(rng, template, float("nan"))
    yield json.dumps(record, allow_nan=True).encode(), f"NaN: {what}"


def _pickle() -> bytes:
    """A pickle whose loading would make :data:`PWNED` (``weights_only`` must refuse it)."""
    return (b"cos\nmakedirs\n(V" + PWNED.encode() + b"\nI01\ntR.")


def _safetensors_bodies(rng: random.Random) -> Iterator[tuple[bytes, str]]:
    yield struct.pack("<Q", 2**62) + b"{}", "a safetensors header that states 4 EiB"
    header = b"[" * DEEP + b"]" * DEEP
    yield struct.pack("<Q", len(header)) + header, "a safetensors header nested deep"
    big = json.dumps({"x": {"dtype": "F32", "shape": [2**20, 2**20],
                            "data_offsets": [0, 2**42]}}).encode()
    yield struct.pack("<Q", len(big)) + big, "a tensor past the file's end"
    yield _pickle(), "a pickle where a tensor file goes"


def bodies(rng: random.Random, family: Family, template: Any) -> Iterator[tuple[bytes, str]]:
    """Every body family of ``family`` that is not a valid object like ``template``."""
    yield bytes(rng.getrandbits(8) for _ in range(64)), "random bytes"
    yield b"", "an empty body"
    if family is Family.SAFETENSORS:
        yield from _safetensors_bodies(rng)
        return
    if family is Family.TORCH:
        yield _pickle(), "a pickle whose loading runs code"
        yield b"PK\x03\x04" + bytes(26), "a zip that ends at its first header"
        return
    if family is Family.BYTES:
        return
    lines = family in (Family.JSONL, Family.JSONL_ZST)
    zst = family in (Family.JSONL_ZST, Family.JSON_ZST)
    for text, what in _json_values(rng, template):
        text += b"\n" if lines else b""
        yield (_zst(text) if zst else text), what
    if lines:
        yield _many_rows(zst), "many small rows under the cap"
    if zst:
        whole = _zst(json.dumps(template).encode())
        yield whole[:max(1, len(whole) // 2)], "truncated zstd"
        yield _zst(json.dumps(template).encode(), size=False), "a frame that hides its size"
        yield bomb(), "a zstd frame that states 2 GiB"


def forgeries(rng: random.Random, run: str, templates: dict[str, Any],
              batch: int = 0) -> list[Forged]:
    """Every role's forgeries against ``run`` (and forged runs), bodies drawn from
    ``templates`` (real records of the run, by :attr:`Layout.template`; ``index_count``: the
    real index object's count; ``existing``: the run's real keys by kind). First each body at
    a key of its own (put once), then, for kinds a writer replaces, bodies put over the keys
    just written and over the run's real objects of that kind. Each ``batch`` (0 to 8) numbers
    its keys apart from the others', so that no batch finds its keys taken."""
    created: list[Forged] = []
    replaced: list[Forged] = []
    late: tuple[list[Forged], list[Forged]] = ([], [])
    # Kinds added after the seeds of REGRESSIONS were recorded draw from a stream of their own
    # (derived from the seed's, which it leaves untouched), so every earlier case of a seed,
    # and the order of its writes, stays what reproduced its failure.
    own = random.Random(repr(rng.getstate()[1][:4]))
    existing: dict[str, list[str]] = templates.get("existing", {})
    for n, layout in enumerate(layouts(templates["index_count"])):
        base = 500 * batch + 20 * n
        template = templates.get(layout.template) or DEFAULT_TEMPLATES.get(layout.template, {})
        draw, (made, over_made) = ((own, late) if layout.kind in LATER_KINDS
                                   else (rng, (created, replaced)))
        for role in writers(layout.key(run, base)):
            found = list(bodies(draw, layout.family, template))
            mine = [layout.key(run, base + i) for i in range(len(found))]
            made += [Forged(role, key, body, what)
                     for key, (body, what) in zip(mine, found, strict=True)]
            if layout.replaced:
                over = sorted(set(mine)) + existing.get(layout.kind.value, [])
                over_made += [Forged(role, key, body, f"over an object: {what}", True)
                              for key in over
                              for body, what in [found[draw.randrange(len(found))]]]
    for role, pattern, family, name in ALMOST:
        key = pattern.format(run=run, n=100000 + 500 * batch, count=templates["index_count"])
        created += [Forged(role, key, body, what)
                    for body, what in bodies(rng, family, templates.get(name, {}))]
    rng.shuffle(created)
    rng.shuffle(replaced)
    own.shuffle(late[0])
    return created + replaced + late[0] + late[1]
