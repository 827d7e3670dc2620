"""The tiny CPU targets the tests and benchmarks run on: built once per build fingerprint into a
cache that outlives a clone, side by side and under the builder's file lock."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from common.choices import TinyModel

ROOT = Path(__file__).resolve().parents[1]
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


TARGETS = (TinyModel.QWEN3.value, TinyModel.QWEN3_5.value)   # the embedded targets: dense, hybrid
HYBRID = TinyModel.QWEN3_5.value


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
