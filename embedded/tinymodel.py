"""The embedded tiny models: Qwen-architecture LMs small enough to build and run on CPU.

They let the whole pipeline (producer, workers, storage) run end to end without a GPU or a model
hub. The first call trains a byte-level BPE tokenizer and a ~2M-parameter model on a synthetic
chat corpus (:mod:`embedded.tinycorpus`), then caches it::

    from embedded.tinymodel import ensure_tiny_model
    cache = settings.target.cache_dir
    path = ensure_tiny_model(cache)                    # tiny-qwen3 (dense)
    path = ensure_tiny_model(cache, "tiny-qwen3.5")    # the hybrid (Qwen3.6 shape)
    path = ensure_tiny_model(cache, "tiny-mimo")       # dense with an MTP head (MiMo)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                     enable_thinking=True)

Replies look like ``<think>\\n...\\n</think>\\n\\n...<|im_end|>``: random words, real structure.
``enable_thinking=False`` pre-fills an empty think block and the model answers directly. The
saved generation config samples (temperature 0.7, top_p 0.95) and stops on ``<|im_end|>`` or
``<|endoftext|>``. Builds run on one thread and are bit-identical for a given torch version; the
names, versions and chat template live in :mod:`embedded.tinyconsts`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from embedded.tinyconsts import (
    READY_MARKER,
    TINY_MIMO,
    TINY_MODEL_VERSION,
    TINY_MODEL_VERSIONS,
    TINY_MODELS,
    TINY_QWEN3,
    TINY_QWEN3_5,
    tiny_model_dir,
)

__all__ = ["READY_MARKER", "TINY_MIMO", "TINY_MODELS", "TINY_MODEL_VERSION",
           "TINY_MODEL_VERSIONS", "TINY_QWEN3", "TINY_QWEN3_5", "ensure_tiny_model",
           "tiny_model_dir"]

logger = logging.getLogger(__name__)


def ensure_tiny_model(cache_dir: Path, name: str = TINY_QWEN3) -> Path:
    """Return the cached tiny model ``name`` under ``cache_dir``, building it once if needed."""
    cache_dir = Path(cache_dir)
    final = tiny_model_dir(cache_dir, name)
    if (final / READY_MARKER).is_file():
        return final
    # tiny-mimo is made from tiny-qwen3: that one first, under its own lock.
    base = ensure_tiny_model(cache_dir, TINY_QWEN3) if name == TINY_MIMO else None
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the build while we waited for the lock.
        if (final / READY_MARKER).is_file():
            return final
        if final.exists():
            logger.warning("removing incomplete tiny model at %s", final)
            shutil.rmtree(final)
        started = time.monotonic()
        logger.info("building tiny model %s in %s", name, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
        try:
            if base is not None:
                from embedded.tinymimo import build as build_from

                build_from(tmp, base)
            else:
                from embedded.tinybuild import build

                build(tmp, name)
            (tmp / READY_MARKER).write_text(f"{TINY_MODEL_VERSIONS[name]}\n")
            # mkdtemp makes the directory private; workers under other users must read it.
            tmp.chmod(0o755)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("tiny model ready in %s (%.1f s)", final, time.monotonic() - started)
    return final
