"""The simulator's command line: its latency and output model, and the SGLang launch flags it
accepts where ``python -m sglang.launch_server`` would go (logged, and the context and metrics
flags honoured as SGLang does)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from embedded import sim_spec
from embedded.sim_model import ANSWER_MODES

DEFAULT_CONTEXT = 32768  # a model directory that states none
SGLANG_FLAGS = ("model_path", "tp", "mem_fraction_static", "served_model_name",
                "context_length", "enable_metrics", "speculative_algorithm",
                "speculative_num_steps", "speculative_eagle_topk",
                "speculative_num_draft_tokens", "mamba_radix_cache_strategy", "device",
                "speculative_draft_model_path")
DEFAULT_MAX_RUNNING = 64


def build_parser() -> argparse.ArgumentParser:
    """The command line; defaults are the latency and output model of the module docstring."""
    p = argparse.ArgumentParser(prog="python -m embedded.simulator",
                                description="An SGLang stand-in with a modelled GPU.")
    add = p.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000, help="0 picks a free port (printed)")
    add("--tokenizer", type=Path, help="HF tokenizer directory (default: built-in vocabulary)")
    add("--max-running", "--max-running-requests", dest="max_running", type=int,
        help=f"batch cap; more requests queue [default: {DEFAULT_MAX_RUNNING}; "
             f"{sim_spec.SPEC_MAX_RUNNING} with speculative decoding, as SGLang]")
    add("--decode-base-ms", type=float, default=2.0)
    add("--decode-per-req-ms", type=float, default=0.05)
    add("--prefill-per-token-us", type=float, default=20.0)
    add("--len-mu", type=float, default=5.3, help="log of the median reply length")
    add("--len-sigma", type=float, default=0.8)
    add("--seed", type=int, default=0)
    add("--time-scale", type=float, default=1.0, help="multiplies every duration")
    add("--answer-mode", choices=ANSWER_MODES, default="normal",
        help="faulty replies for quality-gate tests (see embedded.sim_model)")
    add("--answer-mode-rate", type=float, default=1.0,
        help="fraction of prompts (fixed per prompt) that get the --answer-mode reply")
    add("--fail-rate", type=float, default=0.0, help="fraction of requests answered HTTP 500")
    add("--startup-delay", type=float, default=0.0, help="seconds of 503 on /health")
    add("--log-level", default="info")
    sglang = p.add_argument_group("SGLang launch flags (accepted and logged)")
    sglang.add_argument("--model-path", help="also the tokenizer when it holds tokenizer files")
    sglang.add_argument("--tp", "--tp-size", dest="tp", type=int)
    sglang.add_argument("--mem-fraction-static", type=float)
    sglang.add_argument("--served-model-name")
    sglang.add_argument("--context-length", type=int,
                        help="prompt + new tokens at most [default: the model's]")
    sglang.add_argument("--api-key", help="requests without it are answered 401")
    sglang.add_argument("--enable-metrics", action="store_true", default=None,
                        help="serve /metrics (SGLang serves it only then)")
    sglang.add_argument("--device", help="where SGLang would run (logged: the worker reads it)")
    sglang.add_argument("--mamba-radix-cache-strategy",
                        choices=["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"])
    sim_spec.add_arguments(p.add_argument_group(
        "speculative decoding (SGLang's flags, and the modelled acceptance)"))
    return p


def model_context(args: argparse.Namespace) -> int | None:
    """The model directory's ``max_position_embeddings`` (``text_config``'s when nested)."""
    for where in (args.model_path, args.tokenizer):
        config = Path(where) / "config.json" if where else None
        if config is not None and config.is_file():
            data = json.loads(config.read_text())
            value = (data.get("text_config") or data).get("max_position_embeddings")
            if isinstance(value, int):
                return value
    return None


def tokenizer_path(args: argparse.Namespace) -> Path | None:
    """--tokenizer, else --model-path when it is a directory with tokenizer files."""
    if args.tokenizer:
        return args.tokenizer
    model = Path(args.model_path) if args.model_path else None
    if model and any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return model
    return None
