"""The tiny CPU targets the tests run on (built by :mod:`embedded.tinycache`, which benchmarks
share) and the generated rows kept beside them."""

from __future__ import annotations

import os
from pathlib import Path

from embedded.tinycache import (  # noqa: F401 (re-exported)
    CACHE_DIR,
    HYBRID,
    MT_BENCH,
    ROOT,
    TARGETS,
    build_fingerprint,
    build_models,
    default_test_cache,
    model_builders,
)


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
