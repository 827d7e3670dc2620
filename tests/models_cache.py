"""The tiny CPU targets the tests run on: built once per build fingerprint into a cache that
outlives a clone, side by side and under the builder's file lock."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MT_BENCH = ROOT / "data" / "mt_bench_question.jsonl"


def build_fingerprint() -> str:
    """What the tiny models are built from: the builder's sources, the corpus and the versions
    of the libraries that write them; a change to any of them builds afresh."""
    import hashlib
    from importlib.metadata import version

    digest = hashlib.sha256()
    for name in ("tinybuild", "tinyconsts", "tinycorpus", "tinyhybrid", "tinymimo",
                 "tinymodel"):
        digest.update((ROOT / "embedded" / f"{name}.py").read_bytes())
    digest.update(MT_BENCH.read_bytes())
    for package in ("torch", "transformers", "tokenizers", "safetensors"):
        digest.update(f"{package}={version(package)};".encode())
    return digest.hexdigest()[:16]


def default_test_cache() -> Path:
    """Built test models outlive a clone (as pip's cache does), keyed by what builds them."""
    from common.config import default_cache_dir

    return default_cache_dir() / "test-models" / build_fingerprint()


CACHE_DIR = Path(os.environ.get("DFLASH_TEST_CACHE") or default_test_cache())


TARGETS = ("tiny-qwen3", "tiny-qwen3.5")   # the embedded targets, dense and hybrid
HYBRID = "tiny-qwen3.5"


def model_builders() -> list[Callable[[Path], Path]]:
    """What builds each embedded model the tests run on (one line per model), into a cache
    directory: at most once, under the builder's file lock, so that parallel test processes
    and concurrent sessions wait for one build and share it."""
    from functools import partial

    from embedded.tinymodel import ensure_tiny_model

    return [partial(ensure_tiny_model, name=name) for name in TARGETS]


def build_models() -> float:
    """Build the models missing from the cache side by side, one process each (each build runs
    on one thread, so on 2 cores both take about as long as the slower alone); returns the
    seconds spent (0 when all were cached)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from embedded.tinyconsts import READY_MARKER, tiny_model_dir

    if all((tiny_model_dir(CACHE_DIR, name) / READY_MARKER).is_file() for name in TARGETS):
        return 0.0
    started = time.monotonic()
    builders = model_builders()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(builders), mp_context=spawn) as pool:
        for future in [pool.submit(build, CACHE_DIR) for build in builders]:
            future.result()
    return time.monotonic() - started


def cached_demo_rows(model_dir: Path, target: object, tokenizer: object, prompts: list[str],
                     **options: object) -> list:
    """``demo_rows`` of a built model, kept beside it: the sampling is seeded, so what one run
    generated (minutes of CPU decoding) is what the next would; keyed by the prompts, the
    options and the generating code."""
    import hashlib
    import json
    from dataclasses import asdict

    from common.runs.trainrows import TrainingRow
    from embedded.demo_rows import demo_rows

    digest = hashlib.sha256(json.dumps([prompts, options], sort_keys=True).encode())
    digest.update((ROOT / "embedded" / "demo_rows.py").read_bytes())
    path = model_dir / f"demo-rows-{digest.hexdigest()[:16]}.json"
    if path.is_file():
        return [TrainingRow(**row) for row in json.loads(path.read_text())]
    rows = demo_rows(target, tokenizer, prompts, **options)
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")   # readers never see half
    partial.write_text(json.dumps([asdict(row) for row in rows]))
    os.replace(partial, path)
    return rows
