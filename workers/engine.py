"""The engine interface generate workers drive, and the in-process CPU engine (embedded default).

An engine takes token ids (the chat template is applied once, by the worker) and returns the
exact output token ids with a real finish reason. The SGLang engine speaks the same interface
over HTTP; the CPU engine runs a small local Qwen3 model with ``transformers``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from common.records import Sampling

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenRequest:
    input_ids: list[int]
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class GenResult:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    latency_s: float


class Engine(Protocol):
    """What a generate worker needs from an engine."""

    tokenizer: Any

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Generate one completion per request, results in request order."""

    def info(self) -> dict[str, Any]:
        """A small description recorded with every sample (engine kind, model, version)."""

    def close(self) -> None:
        """Release the engine's resources."""


def _batches(order: list[int], size: int) -> list[list[int]]:
    return [order[i : i + size] for i in range(0, len(order), size)]


class CpuEngine:
    """A ``transformers`` causal LM on CPU, batched with left padding, sorted by length."""

    def __init__(self, model_path: Path, batch_size: int = 16, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.model_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.eval()
        self.batch_size = batch_size
        self.stop_ids = _stop_ids(self.tokenizer, self.model)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.stop_ids[0]
        self._lock = threading.Lock()  # one forward at a time: torch already uses every core
        torch.manual_seed(seed)
        log.info("cpu engine loaded %s (stop ids %s)", model_path, self.stop_ids)

    def info(self) -> dict[str, Any]:
        return {"engine": "cpu", "model": str(self.model_path)}

    def close(self) -> None:
        self.model = None

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        results: list[GenResult | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].input_ids))
        for batch in _batches(order, self.batch_size):
            for index, result in zip(batch, self._generate_batch([requests[i] for i in batch]),
                                     strict=True):
                results[index] = result
        return [r for r in results if r is not None]

    def _generate_batch(self, requests: list[GenRequest]) -> list[GenResult]:
        torch = self._torch
        sampling = requests[0].sampling
        width = max(len(r.input_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, width - len(request.input_ids) :] = torch.tensor(request.input_ids)
            mask[row, width - len(request.input_ids) :] = 1
        started = time.perf_counter()
        with self._lock, torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=sampling.max_new_tokens,
                do_sample=sampling.temperature > 0,
                temperature=sampling.temperature if sampling.temperature > 0 else None,
                top_p=sampling.top_p if sampling.temperature > 0 else None,
                top_k=sampling.top_k if sampling.temperature > 0 else None,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
            )
        latency = time.perf_counter() - started
        return [
            self._result(request, out[row, width:].tolist(), latency)
            for row, request in enumerate(requests)
        ]

    def _result(self, request: GenRequest, tokens: list[int], latency: float) -> GenResult:
        output: list[int] = []
        for token in tokens:
            output.append(token)
            if token in self.stop_ids:
                break
        stopped = bool(output) and output[-1] in self.stop_ids
        return GenResult(
            output_ids=output,
            finish_reason="stop" if stopped else "length",
            prompt_tokens=len(request.input_ids),
            completion_tokens=len(output),
            latency_s=latency,
        )


def _stop_ids(tokenizer: Any, model: Any) -> list[int]:
    """End-of-turn tokens: the generation config's eos ids, else the tokenizer's eos."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)
