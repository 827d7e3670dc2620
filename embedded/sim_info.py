"""What the simulator reports of itself, in SGLang's shapes: ``/get_server_info`` and
``/metrics`` (``sglang:*`` names, plus ``sim_max_running_reqs``, the batch cap)."""

from __future__ import annotations

import argparse
from typing import Any

from embedded.sim_spec import SpecModel


def accept_length(stats: dict[str, int]) -> float:
    """Tokens per verify step over every request so far (SGLang's gauge: a recent window)."""
    return stats["verified_tokens"] / max(1, stats["verify_steps"])


def server_info_body(args: argparse.Namespace, context: int, spec: SpecModel | None,
                     stats: dict[str, int]) -> dict[str, Any]:
    """The limits the worker reads back, and the speculative settings as SGLang resolves them."""
    state: dict[str, Any] = {"effective_max_running_requests_per_dp": args.max_running}
    if spec is not None and stats["verify_steps"]:
        state["avg_spec_accept_length"] = accept_length(stats)
    return {"version": "simulator", "max_req_input_len": context - 6,
            "context_length": args.context_length, "max_running_requests": args.max_running,
            **(spec.server_info() if spec else {"speculative_algorithm": None}),
            "internal_states": [state]}


def metrics_text(snapshot: dict[str, int], model_name: str, max_running: int,
                 speculative: bool) -> str:
    """Prometheus text with SGLang's metric names (those the dashboard reads)."""
    s, label = snapshot, f'{{model_name="{model_name}"}}'
    rows = [("sglang:num_running_reqs", "gauge", "Running requests.", s["running"]),
            ("sglang:num_queue_reqs", "gauge", "Queued requests.", s["queued"]),
            ("sglang:generation_tokens_total", "counter", "Generation tokens processed.",
             s["generated_tokens"]),
            ("sglang:prompt_tokens_total", "counter", "Prefill tokens processed.",
             s["prompt_tokens"]),
            ("sglang:num_requests_total", "counter", "Requests completed.", s["completed"]),
            ("sim_max_running_reqs", "gauge", "The simulator's batch cap.", max_running)]
    if speculative:
        rows.append(("sglang:spec_accept_length", "gauge",
                     "The average acceptance length of speculative decoding.",
                     accept_length(s)))
    return "".join(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n{name}{label} {float(v)}\n"
                   for name, kind, doc, v in rows)
