"""Objects no reader should take for a record, each at a key a role of the stack may write: the
generator of tests/test_fuzz_layout.py.

    for forged in forgeries(random.Random(seed), run, templates):
        forged.role, forged.key, forged.body     # written with that role's key

Every key template a role may write (docs/policies/<role>.json) gets bodies that are not valid
records of their key: not JSON, JSON of the wrong type at one field of a real record, counts out
of range or huge, truncated zstd, a zstd frame that hides its size, a compression bomb, an empty
body. Keys parse (a commit of a shard past the run's last, the newest checkpoint step, an index
object with the real one's count and a tag that lists before it) or almost parse (a digit short,
a tag not hex). A well-formed record a role may legitimately write is its stage's own output,
not in scope.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zstandard

BOMB_BYTES = 2 * 2**30   # what the bomb decompresses to: a reader that inflates it is gone
WRONG = ("a string", -1, 10**18, 1.5, None, True, [0], {"x": 1})


@dataclass(frozen=True)
class Forged:
    role: str
    key: str
    body: bytes
    what: str


def bomb() -> bytes:
    """~64 KiB of zstd that decompresses to :data:`BOMB_BYTES` (its frame states the size)."""
    chunk = zstandard.ZstdCompressor(level=19)
    writer = chunk.compressobj(size=BOMB_BYTES)
    zero = b"\0" * 2**24
    out = [writer.compress(zero) for _ in range(BOMB_BYTES // len(zero))]
    return b"".join(out) + writer.flush()


_BOMB: bytes | None = None


def _bomb() -> bytes:
    global _BOMB
    if _BOMB is None:
        _BOMB = bomb()
    return _BOMB


def mutated(rng: random.Random, record: Any) -> tuple[Any, str]:
    """``record`` with one field (at any depth) given a value of the wrong type or range."""
    record = copy.deepcopy(record)
    paths: list[list[Any]] = []

    def walk(value: Any, path: list[Any]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                paths.append([*path, k])
                walk(v, [*path, k])
        elif isinstance(value, list) and value:
            paths.append([*path, 0])
            walk(value[0], [*path, 0])

    walk(record, [])
    if not paths:
        return rng.choice(WRONG), "not an object"
    path = rng.choice(paths)
    parent = record
    for step in path[:-1]:
        parent = parent[step]
    wrong = rng.choice([w for w in WRONG if type(w) is not type(parent[path[-1]])])
    parent[path[-1]] = wrong
    return record, f"{'.'.join(map(str, path))} = {wrong!r}"


def bodies(rng: random.Random, template: Any, zst: bool, lines: bool) -> Iterator[
        tuple[bytes, str]]:
    """Bodies that are not a valid record like ``template`` (zstd-compressed where the key's
    objects are: ``zst``; a JSON line per record: ``lines``)."""
    def encode(value: Any) -> bytes:
        text = json.dumps(value).encode() + (b"\n" if lines else b"")
        return zstandard.ZstdCompressor().compress(text) if zst else text

    record, what = mutated(rng, template)
    yield encode(record), f"wrong type: {what}"
    yield encode(rng.choice(WRONG)), "JSON of another type"
    yield bytes(rng.getrandbits(8) for _ in range(64)), "not JSON"
    yield b"", "an empty body"
    if zst:
        whole = encode(template)
        yield whole[:max(1, len(whole) // 2)], "truncated zstd"
        streamed = zstandard.ZstdCompressor(write_content_size=False).compress(
            json.dumps(template).encode())
        yield streamed, "a zstd frame that hides its size"
    yield _bomb(), "a compression bomb"


def forgeries(rng: random.Random, run: str, templates: dict[str, Any],
              batch: int = 0) -> list[Forged]:
    """Every role's forgeries against ``run`` (and a forged run of the producer's), the bodies
    drawn from ``templates`` (real records of the run: commit, manifest, checkpoint, sample,
    input row, resume, pause, bench verdict, index object's decoded JSON, and its count of
    shards). In a key,
    ``{shard}`` is a shard past the run's last, ``{part}`` a part number no worker wrote,
    ``{step}`` a step past every real one, ``{tag}`` an index tag that lists before any random
    one, ``{stamp}`` a gate stamp that sorts before every real one; each ``batch`` (0 to 8)
    numbers its keys apart from the others', so that no batch finds its keys taken."""
    out: list[Forged] = []
    count = templates["index_count"]

    def add(role: str, key: str, template: str, zst: bool = False, lines: bool = False) -> None:
        for body, what in bodies(rng, templates[template], zst, lines):
            n = len(out) + 500 * batch
            out.append(Forged(role, key.format(
                shard=f"{100000 + n:06d}", part=f"{5000 + n:04d}", step=f"{900000 + n:06d}",
                tag=f"{n:08x}", stamp=f"00000000T000000.{n:06d}-000000", run=run), body, what))

    add("producer", "runs/{run}-forged/run.json", "run")   # a run whose run.json is foreign
    add("producer", "runs/{run}/inputs/shard-{shard}.jsonl.zst", "input_row", True, True)
    add("producer", "runs/{run}/inputs/_MANIFEST.json", "manifest")   # taken: refused
    add("producer", "runs/{run}/gates/resume-{stamp}.json", "resume")
    add("producer", "runs/{run}/bench/unknown-tp1-0123abcd/verdict-{stamp}.json", "bench")
    add("generate", "runs/{run}/generated/shard-000000/part-{part}.jsonl.zst", "sample", True,
        True)
    add("generate", "runs/{run}/rejected/shard-000001/part-{part}.jsonl.zst", "sample", True,
        True)
    add("generate", "runs/{run}/generated/shard-{shard}/_COMMIT.json", "commit")
    add("generate", "runs/{run}/generated/shard-{shard}/part-0000.jsonl.zst", "sample", True,
        True)
    add("generate", "runs/{run}/generated/shard-0{part}/_COMMIT.json", "commit")  # 5 digits
    add("generate", "runs/{run}/gates/pause-{stamp}.json", "pause")
    add("hidden", "runs/{run}/hidden/shard-{shard}/_COMMIT.json", "commit")
    add("hidden", "runs/{run}/hidden/shard-{shard}/index.json", "commit")
    add("train", "runs/{run}/drafter/step-{step}/_COMMIT.json", "checkpoint")
    add("train", "runs/{run}/drafter/step-{step}/state.pt", "checkpoint")
    add("train", "runs/{run}/drafter/step-{step}0/_COMMIT.json", "checkpoint")   # 7 digits
    chunk = "runs/{run}/index/commits/chunk-0000-" + f"{count:03d}"
    for role in ("producer", "generate", "hidden", "train", "reconciler"):
        add(role, chunk + "-{tag}.json.zst", "index", True)
        add(role, chunk + "-{tag}g.json.zst", "index", True)   # 9 characters: no index object
    rng.shuffle(out)
    return out
