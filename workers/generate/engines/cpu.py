"""The in-process CPU engine (the embedded default): a ``transformers`` model, batched."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.choices import EngineKind, FinishReason
from common.errors import EngineError
from workers.generate.engines.base import EngineInfo, GenRequest, GenResult

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from common.engine.mtp import MtpChoice
    from workers.generate.engines.server import EngineServer

log = logging.getLogger(__name__)


class CpuEngine:
    """A ``transformers`` causal LM on CPU, batched with left padding, sorted by length."""

    def __init__(self, model_path: Path, batch_size: int = 16, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.model_path = model_path
        # No server and no speculative decoding: the Engine protocol's fields, stated.
        self.mtp: MtpChoice | None = None
        self.algorithm: str | None = None
        self.url: str | None = None
        self.server: EngineServer | None = None
        self.in_flight = 0
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_path)
        # transformers' generate() is untyped at its call site (pyproject: untyped calls).
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.eval()
        self.batch_size = batch_size
        self.stop_ids = _stop_ids(self.tokenizer, self.model)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.stop_ids[0]
        self._pending: list[tuple[GenRequest, asyncio.Future[GenResult]]] = []
        self._wake: asyncio.Event | None = None
        self._batcher: asyncio.Task[None] | None = None
        torch.manual_seed(seed)
        log.info("cpu engine loaded %s (stop ids %s)", model_path, self.stop_ids)

    def info(self) -> EngineInfo:
        return {"engine": EngineKind.CPU, "model": str(self.model_path)}

    def close(self) -> None:
        self.model = None   # the weights go; the engine is done

    async def generate(self, request: GenRequest) -> GenResult:
        """Queue the request for the batcher; one forward at a time, torch uses every core."""
        if self._batcher is None:
            self._wake = asyncio.Event()
            self._batcher = asyncio.get_running_loop().create_task(self._run_batches())
        future: asyncio.Future[GenResult] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        assert self._wake is not None
        self._wake.set()
        return await future

    async def _run_batches(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                # One sampling setting per batch; shortest prompts together keep padding small.
                sampling = self._pending[0][0].sampling
                same = sorted((item for item in self._pending if item[0].sampling == sampling),
                              key=lambda item: len(item[0].input_ids))
                batch = same[: self.batch_size]
                taken = {id(item) for item in batch}
                self._pending = [item for item in self._pending if id(item) not in taken]
                batch = [item for item in batch if not item[1].cancelled()]
                if not batch:
                    continue
                try:
                    results = await asyncio.to_thread(
                        self._generate_batch, [request for request, _ in batch])
                except (RuntimeError, ValueError) as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(EngineError(f"cpu engine failed: {exc}"))
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)

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
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=sampling.max_new_tokens,
                do_sample=sampling.temperature > 0,
                temperature=sampling.temperature if sampling.temperature > 0 else None,
                top_p=sampling.top_p if sampling.temperature > 0 else None,
                top_k=sampling.top_k if sampling.temperature > 0 and sampling.top_k > 0 else None,
                min_p=sampling.min_p if sampling.temperature > 0 and sampling.min_p else None,
                repetition_penalty=(sampling.repetition_penalty
                                    if sampling.repetition_penalty != 1.0 else None),
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
            finish_reason=FinishReason.STOP if stopped else FinishReason.LENGTH,
            prompt_tokens=len(request.input_ids),
            completion_tokens=len(output),
            latency_s=latency,
        )


def _stop_ids(tokenizer: PreTrainedTokenizerBase, model: Any) -> list[int]:
    """End-of-turn tokens: the generation config's eos ids, else the tokenizer's eos."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)
