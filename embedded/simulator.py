"""An SGLang stand-in for CPU tests and benchmarks: SGLang's HTTP protocol, a modelled GPU.

Run it where ``python -m sglang.launch_server`` would go (SGLang's ``--model-path``, ``--tp``,
``--mem-fraction-static`` and ``--served-model-name`` are accepted and logged; the model path is
also the tokenizer when it holds one)::

    python -m embedded.simulator --port 30000 [--host 127.0.0.1] [--tokenizer DIR]
        [--max-running 64] [--decode-base-ms 2.0] [--decode-per-req-ms 0.05]
        [--prefill-per-token-us 20] [--len-mu 5.3] [--len-sigma 0.8] [--seed 0]
        [--time-scale 1.0] [--answer-mode normal|degenerate|empty|unclosed|leak]
        [--answer-mode-rate 1] [--fail-rate 0] [--startup-delay 0]
        [--speculative-algorithm NEXTN [--speculative-num-steps 3] [--accept-length 2.5]
         [--draft-step-ms 0.2]]

It prints ``simulator listening on http://HOST:PORT`` when ready and exits cleanly on SIGTERM.
Endpoints: ``POST /generate`` (SGLang's native shape, ``input_ids`` only, a list of lists for a
batch), ``POST /v1/chat/completions``, ``GET /health`` (503 during --startup-delay),
``/health_generate``, ``/get_model_info``, ``/v1/models`` (``max_model_len``: the context),
``/get_server_info`` (``max_req_input_len``, the running-request limit), ``POST /abort_request``
(``{"rid": ...}``: that request answers at once, finish ``abort``), ``/metrics`` (only with
``--enable-metrics``, as SGLang: its ``sglang:*`` names plus ``sim_max_running_reqs``, the batch
cap) and ``/sim/stats`` (counters for tests). Requests SGLang refuses are refused with its
status and words (tests/test_sglang_real.py holds the two side by side): a prompt too long for
``--context-length`` (default: the model's ``max_position_embeddings``, else 32768), prompt plus
``max_new_tokens`` beyond it, sampling values outside SGLang's limits.

Latency model: one asyncio loop steps all running requests together (continuous batching). At
most --max-running requests run (64; 48 with speculative decoding, as SGLang); the rest queue in
arrival order. Each step lasts::

    step_ms = decode_base_ms + decode_per_req_ms * tokens + prefill_per_token_us / 1000 * P

where ``tokens`` counts the tokens the step decodes (one per running request; with speculative
decoding, S + 1 verified per request past its prefill, plus S x --draft-step-ms for the drafts:
:mod:`embedded.sim_spec`) and ``P`` the prompt tokens of the requests admitted at its start (they
pay their prefill there). Every running request emits one token per step (a verify step: the
drafts it accepts, plus one) and is answered after its last one, so throughput grows with
concurrency up to the cap and is flat beyond it. --time-scale multiplies every duration.

Output (details in :mod:`embedded.sim_model`): ``<think>`` reasoning ``</think>\\n\\n``
answer ``<|im_end|>``, lognormal length (median ``exp(len_mu)``, ~200 tokens), fixed by --seed and
the input_ids alone (same prompt, same reply, whatever the sampling params); finish ``stop`` at the
end-of-turn or a ``stop_token_ids`` id, ``length`` at max_new_tokens. Real ids with --tokenizer,
else a built-in table. --fail-rate answers that fraction of requests HTTP 500.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from embedded.sim_args import (
    DEFAULT_CONTEXT,
    DEFAULT_MAX_RUNNING,
    SGLANG_FLAGS,
    build_parser,
    model_context,
    tokenizer_path,
)
from embedded.sim_info import metrics_text, server_info_body
from embedded.sim_model import Vocab, finish, plan_output, request_rng
from embedded.sim_requests import BadRequest, check_context, parse_generate, parse_sampling
from embedded.sim_scheduler import LatencyModel, Scheduler
from embedded.sim_spec import SPEC_MAX_RUNNING, spec_model

log = logging.getLogger(__name__)

CHAT_MAX_TOKENS = 4096  # chat requests without max_tokens run to "the context length"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class Simulator:
    """The HTTP front of the simulated engine."""

    def __init__(self, args: argparse.Namespace, tokenizer: Path | None) -> None:
        self.args = args
        self.vocab = Vocab(tokenizer)
        self.spec = spec_model(args)
        self.scheduler = Scheduler(LatencyModel(
            args.max_running, args.decode_base_ms, args.decode_per_req_ms,
            args.prefill_per_token_us, args.time_scale, self.spec))
        self.stats = self.scheduler.stats
        self.stats["failed"] = self.stats["cache_flushes"] = 0
        self._fail_rng = random.Random(args.seed)
        self.ready_at = float("inf")
        self.stopping = False
        self.model_name = args.served_model_name or args.model_path or "sglang-simulator"
        self.context = args.context_length or model_context(args) or DEFAULT_CONTEXT

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """SGLang's --api-key: 401 without the bearer key, except health and metrics."""
        key = self.args.api_key
        if key and not request.path.startswith(("/health", "/metrics")) \
                and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2, middlewares=[self._auth])
        app.add_routes([
            web.post("/generate", self.generate), web.post("/v1/chat/completions", self.chat),
            web.get("/health", self.health), web.get("/health_generate", self.health),
            web.get("/get_model_info", self.model_info), web.get("/v1/models", self.models),
            web.get("/get_server_info", self.server_info), web.get("/sim/stats", self.sim_stats),
            web.post("/abort_request", self.abort_request),
            web.route("*", "/flush_cache", self.flush_cache),
        ])
        if self.args.enable_metrics:
            app.add_routes([web.get("/metrics", self.metrics)])
        app.cleanup_ctx.append(self._run_scheduler)
        return app

    async def _run_scheduler(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.scheduler.loop())
        yield
        task.cancel()

    def mark_started(self) -> None:
        self.ready_at = time.monotonic() + self.args.startup_delay * self.args.time_scale

    def _unavailable(self) -> web.Response | None:
        if time.monotonic() < self.ready_at or self.stopping:
            return _error(503, "the simulated model is loading or stopping")
        if self.args.fail_rate and self._fail_rng.random() < self.args.fail_rate:
            self.stats["failed"] += 1
            return _error(500, "simulated engine failure (--fail-rate)")
        return None

    async def _run(self, ids: list[int], max_new: int, stops: set[int],
                   rid: str | None = None) -> tuple[list[int], dict, float, dict]:
        started = time.monotonic()
        self.stats["requests"] += 1
        full = plan_output(self.vocab, ids, self.args.seed, self.args.answer_mode,
                           self.args.len_mu, self.args.len_sigma, self.args.answer_mode_rate)
        out, reason = finish(full, max_new, stops | {self.vocab.eot})
        # Draws of drafts fixed by the prompt too; the verify commits the target's ids.
        rng = request_rng(self.args.seed + 1, ids) if self.spec else None
        job = await self.scheduler.run(len(ids), out, rid, rng)
        if job.remaining:   # SGLang's words and shape for an aborted request
            reason = {"type": "abort", "message": "Aborted", "status_code": None,
                      "err_type": None}
        out = job.out
        spec = job.spec.meta_info(len(out), self.spec.steps) if self.spec else {}
        return out, reason, time.monotonic() - started, spec

    async def generate(self, request: web.Request) -> web.Response:
        if (refused := self._unavailable()) is not None:
            return refused
        try:
            prompts, params, rids, batch = parse_generate(await request.json())
            for prompt, sampling in zip(prompts, params, strict=True):
                check_context(len(prompt), sampling[0], self.context)
        except ValueError as exc:  # BadRequest, or a body that is not JSON
            return _error(400, str(exc))
        results = await asyncio.gather(*(
            self._run(p, s[0], s[1], rid if isinstance(rid, str) else None)
            for p, s, rid in zip(prompts, params, rids, strict=True)))
        outs = [{
            "text": self.vocab.decode(out, skip_special_tokens=sampling[2]),
            "output_ids": out,
            "meta_info": {"id": rid if isinstance(rid, str) else uuid.uuid4().hex,
                          "finish_reason": reason, "prompt_tokens": len(ids),
                          "completion_tokens": len(out), "cached_tokens": 0,
                          "e2e_latency": latency, **spec},
        } for (out, reason, latency, spec), ids, sampling, rid in zip(results, prompts, params,
                                                                      rids, strict=True)]
        return web.json_response(outs if batch else outs[0])

    async def chat(self, request: web.Request) -> web.Response:
        if (refused := self._unavailable()) is not None:
            return refused
        try:
            body = await request.json()
            messages = body.get("messages") if isinstance(body, dict) else None
            if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                       for m in messages):
                raise BadRequest("messages must be a non-empty list of {role, content} objects")
            max_new, stops, _ = parse_sampling({
                "max_new_tokens": body.get("max_completion_tokens",
                                           body.get("max_tokens") or CHAT_MAX_TOKENS)})
        except ValueError as exc:
            return _error(400, str(exc))
        prompt = "".join(f"<|im_start|>{m.get('role')}\n{m['content']}<|im_end|>\n"
                         for m in messages) + "<|im_start|>assistant\n"
        ids = self.vocab.encode(prompt)
        out, reason, _, _ = await self._run(ids, max_new, stops)
        text = self.vocab.decode(out)
        # Like SGLang's reasoning parser: a reply cut inside its think block is all reasoning.
        head, sep, tail = text.partition("</think>")
        thinking = text.startswith("<think>")
        reasoning = head.removeprefix("<think>").strip() if sep or thinking else None
        content = tail.strip() if sep else ("" if thinking else text)
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "finish_reason": reason["type"],
                         "matched_stop": reason.get("matched"),
                         "message": {"role": "assistant", "content": content,
                                     "reasoning_content": reasoning}}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                      "total_tokens": len(ids) + len(out)},
        })

    async def health(self, request: web.Request) -> web.Response:
        down = time.monotonic() < self.ready_at or self.stopping
        return web.Response(status=503 if down else 200)

    async def model_info(self, request: web.Request) -> web.Response:
        path = self.vocab.path
        return web.json_response({"model_path": self.args.model_path or self.model_name,
                                  "tokenizer_path": str(path) if path else None,
                                  "is_generation": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's /abort_request: the request answers at once, finish ``abort``."""
        try:
            rid = (await request.json()).get("rid")
        except (ValueError, AttributeError):
            return _error(400, "the body must be a JSON object with a rid")
        if isinstance(rid, str):
            self.scheduler.abort(rid)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's /flush_cache (nothing cached here): done, and counted, once nothing runs or
        waits within ``?timeout`` seconds; else 400, as SGLang."""
        deadline = time.monotonic() + float(request.query.get("timeout") or 0)
        while self.scheduler.running or self.scheduler.queue:
            if time.monotonic() >= deadline:
                return web.Response(status=400, text="Cache not flushed: requests pending.\n")
            await asyncio.sleep(0.01)
        self.stats["cache_flushes"] += 1
        return web.Response(text="Cache flushed.\n")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "owned_by": "sglang",
            "max_model_len": self.context}]})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(server_info_body(self.args, self.context, self.spec,
                                                  self.stats))

    def snapshot(self) -> dict[str, int]:
        return {**self.stats, "running": len(self.scheduler.running),
                "queued": len(self.scheduler.queue)}

    async def sim_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    async def metrics(self, request: web.Request) -> web.Response:
        text = metrics_text(self.snapshot(), self.model_name, self.args.max_running,
                            self.spec is not None)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT."""
    sim = Simulator(args, tokenizer_path(args))
    runner = web.AppRunner(sim.app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    port = runner.addresses[0][1]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    sim.mark_started()
    print(f"simulator listening on http://{args.host}:{port}", flush=True)
    await stop.wait()
    log.info("stopping: %s", sim.snapshot())
    # In-flight requests are answered at once with their partial output (finish "abort"): the
    # one deliberate difference from SGLang, which drains them (tests/test_sglang_real.py):
    # a test's teardown never waits on the requests of a worker it is about to stop.
    sim.stopping = True
    sim.scheduler.abort_all()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = spec_model(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.max_running is None:   # SGLang caps a speculative server at 48 unless told
        args.max_running = SPEC_MAX_RUNNING if spec else DEFAULT_MAX_RUNNING
    if args.max_running < 1 or args.time_scale <= 0 or not 0 <= args.fail_rate <= 1:
        parser.error("need --max-running >= 1, --time-scale > 0 and 0 <= --fail-rate <= 1")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in SGLANG_FLAGS:
        if getattr(args, name) is not None:
            log.info("SGLang flag --%s=%s accepted", name.replace("_", "-"), getattr(args, name))
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
