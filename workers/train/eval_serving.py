"""``eval-drafter --engine sglang``: a set's prompts through a running SGLang, at concurrency.

    level = measure(url, prompt_ids, max_new_tokens=512, concurrency=8)
    level["tokens_per_s"], level["spec_accept_length"]     # SGLang's own meta_info figures

Each prompt goes to ``POST /generate`` as token ids, greedy (temperature 0, top_k 1), as z-lab's
``dflash/benchmark.py`` server path sends it; ``concurrency`` requests are in flight at once and
the set's output tokens over its wall time are its tokens/s. The cache is flushed before a
warm-up of ``concurrency`` requests and again after it, so no prompt finds its prefix cached.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.errors import ConfigError

log = logging.getLogger(__name__)

WARMUP_TOKENS = 8
TIMEOUT_S = 3600.0
MAX_LEVEL = 4096   # requests in flight: a thread each; past any server's running batch


def _post(url: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    request = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            out = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise ConfigError(f"{url}/generate answered HTTP {exc.code}: "
                          f"{exc.read()[:200].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(f"{url} is not answering ({exc}); start SGLang there (the lines: "
                          "`dflash-pipeline serve-command dflash --drafter DIR`)") from None
    out = out[0] if isinstance(out, list) and out else out
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise ConfigError(f"{url}/generate answered without meta_info: {str(out)[:200]}")
    return out


def _flush(url: str) -> None:
    try:
        urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"),
                               timeout=60).close()
    except (urllib.error.URLError, OSError) as exc:
        log.warning("%s/flush_cache failed (%s); measuring with its cache as it is", url, exc)


def _send(url: str, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    return _post(url, {"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "top_k": 1, "max_new_tokens": max_new_tokens}})


def measure(url: str, prompts: Sequence[list[int]], max_new_tokens: int, concurrency: int,
            speculative: bool = True) -> dict[str, Any]:
    """Tokens/s of ``prompts`` at ``concurrency``, and SGLang's acceptance figures when
    ``speculative`` (a ConfigError when no reply carries them: the server does not speculate)."""
    url = url.rstrip("/")
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        _flush(url)
        list(pool.map(lambda ids: _send(url, ids, WARMUP_TOKENS), prompts[:concurrency]))
        _flush(url)
        started = time.perf_counter()
        replies = list(pool.map(lambda ids: _send(url, ids, max_new_tokens), prompts))
        seconds = time.perf_counter() - started
    metas = [r["meta_info"] for r in replies]
    tokens = sum(int(m.get("completion_tokens") or 0) for m in metas)
    lengths = [float(m["spec_accept_length"]) for m in metas
               if m.get("spec_accept_length") is not None]
    verify = sum(int(m.get("spec_verify_ct") or 0) for m in metas)
    if speculative and not lengths and tokens > len(metas):
        raise ConfigError(f"{url} answered without spec_accept_length/spec_verify_ct: is it "
                          "serving the drafter (--speculative-algorithm DFLASH)?")
    log.info("%s at concurrency %d: %d prompts, %d tokens in %.2f s, %d verify steps",
             url, concurrency, len(prompts), tokens, seconds, verify)
    return {"tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 3),
            "spec_accept_length": round(sum(lengths) / len(lengths), 4) if lengths else None,
            "spec_verify_ct": verify if speculative else None}


def measure_levels(url: str, baseline: str | None, prompts: Sequence[list[int]],
                   max_new_tokens: int, levels: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Each concurrency level on the drafter's server and, given, the baseline's: speedup."""
    out: dict[int, dict[str, Any]] = {}
    for level in levels:
        spec = measure(url, prompts, max_new_tokens, level)
        base = (measure(baseline, prompts, max_new_tokens, level, speculative=False)
                if baseline else None)
        base_rate = base["tokens_per_s"] if base else None
        out[level] = {**spec, "baseline_tokens_per_s": base_rate,
                      "speedup": round(spec["tokens_per_s"] / base_rate, 4)
                      if base_rate else None}
    return out


def check_levels(prompts: Mapping[str, int], levels: Sequence[int]) -> list[str]:
    """A line per set whose prompts are fewer than a level: no more requests than its prompts
    are ever in flight, so that level's figures are those of its prompt count (logged as a
    warning beside the table; raise --num, or lower the level, to measure it)."""
    return [f"--concurrency {level}: set {name} has {n} prompts, so at most {n} requests are "
            f"in flight at level {level}: its figures there are those of concurrency {n}"
            for name, n in prompts.items() for level in levels if n < level]


def parse_levels(value: str) -> list[int]:
    """``1,8,32`` -> [1, 8, 32]: each from 1 to :data:`MAX_LEVEL`, distinct, ascending."""
    try:   # every part an integer: "1,,8" is a typo, not the levels 1 and 8
        levels = sorted({int(part) for part in value.split(",")})
    except ValueError:
        raise ConfigError(f"--concurrency {value}: a comma-separated list of integers, "
                          "e.g. 1,8,32") from None
    if levels[0] < 1 or levels[-1] > MAX_LEVEL:
        raise ConfigError(f"--concurrency {value}: each level must be from 1 to {MAX_LEVEL} "
                          "(requests in flight at once)")
    return levels
