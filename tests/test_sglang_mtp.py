"""Generation through the target's own MTP head (SGLang's NEXTN) on the real engine: tiny-mimo.

tiny-mimo is the dense embedded target with an MTP head in the one dense shape SGLang serves
NEXTN for (MiMo's). Under greedy decoding, a generate worker whose SGLang drafts with that head
must store exactly what a worker without it stores, token for token: speculative decoding may
change the speed, never the output. Where the pinned SGLang refuses speculative decoding on
the CPU (0.5.23 does without sgl-kernel's CPU build: docs/guides/gpu-hosts.md), that test skips
with SGLang's own error line, read from the server's log; the target itself must still serve
token-exact without MTP, so a skip never hides a broken target.
"""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from common.engine.sampling import Sampling
from common.engine.serving import NEXTN, mtp_engine_args
from common.engine.target import TargetShape
from common.errors import EngineError
from embedded.tinyconsts import TINY_MIMO
from tests.conftest import Pipeline, call_json, free_port
from tests.sglang_real import engine_env, real_server, require_sglang
from tests.test_generate_e2e import _committed_samples, _mt_bench_rows, _write_jsonl

# One worker process runs the real-engine tests one after the other: each server takes a core.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("sglang")]

# A Python exception line as SGLang's scheduler logs it ("RuntimeError: ...").
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): .+")
# The documented refusal of NEXTN on the CPU without sgl-kernel's CPU build
# (docs/guides/gpu-hosts.md, "MTP (NEXTN) on the CPU"): Triton has no CPU driver for the KV-copy
# kernel the pool warms up. Any other error of the server fails the test.
CPU_REFUSAL = "RuntimeError: 0 active drivers ([]). There should only be one."
GREEDY_TOKENS = 40


@pytest.fixture(scope="session")
def mimo(model_cache: Path) -> Path:
    from embedded.tinymodel import ensure_tiny_model

    return ensure_tiny_model(model_cache, TINY_MIMO)   # about a minute, once per build


def mtp_flags(mimo: Path) -> list[str]:
    """The NEXTN flags the product builds for the target (``common.engine.serving``)."""
    return mtp_engine_args(TargetShape.from_dir(mimo))


def mtp_worker_args(mimo: Path, port: int, on: bool) -> tuple[list[str], dict[str, str]]:
    """A generate worker's extra CLI arguments and environment with MTP on or off: the
    worker's own ``--mtp`` (greedy decoding, so the CPU may verify by argmax)."""
    return ["--mtp", "on" if on else "off"], engine_env(port)


def mtp_refusal(mimo: Path, run_dir: Path) -> str | None:
    """None when the real SGLang comes up with NEXTN on ``mimo``; its documented CPU refusal
    (:data:`CPU_REFUSAL`) where that is what stopped it; any other failure raises."""
    port = free_port()
    try:
        with real_server(mimo, run_dir, port, *mtp_flags(mimo)):
            return None
    except EngineError:
        log = (run_dir / "engines" / f"engine-{port}.log").read_text(errors="replace")
        errors = [line for line in log.splitlines() if _ERROR_LINE.match(line)]
        if not any(line.strip() == CPU_REFUSAL for line in errors):
            raise AssertionError("SGLang failed with NEXTN for a reason other than its "
                                 f"documented CPU refusal: {errors[-3:] or log[-2000:]}") from None
        return CPU_REFUSAL


def _prompts(mimo: Path, n: int) -> list[list[int]]:
    """The first turns of ``n`` MT-Bench rows, rendered by the target's template."""
    from transformers import AutoTokenizer

    from common.gates.turns import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(mimo)
    return [render_prompt(tokenizer, [{"role": "user", "content": row["turns"][0]}], Sampling())
            for row in _mt_bench_rows(n)]


def test_tiny_mimo_states_an_mtp_head_that_predicts(mimo: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from embedded.tinymimo import ARCHITECTURE, MtpLayer

    shape = TargetShape.from_dir(mimo)
    assert shape.has_mtp and not shape.is_hybrid and shape.architectures == (ARCHITECTURE,)
    assert mtp_flags(mimo)[:2] == ["--speculative-algorithm", NEXTN]
    trunk = AutoModelForCausalLM.from_pretrained(mimo).eval()   # no remote code: Qwen2 layers
    head = MtpLayer.from_checkpoint(mimo, trunk.config)
    hits = total = 0
    for prompt in _prompts(mimo, 3):
        ids = trunk.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS,
                             do_sample=False)
        with torch.no_grad():
            hidden = trunk(ids, output_hidden_states=True).hidden_states[-1]
            guess = head(trunk, hidden[:, :-2], ids[:, 1:-1]).argmax(-1)[0]
        # The head's guess for the token after next, over the generated reply, against the
        # trunk's own greedy choice there: what NEXTN's verification accepts.
        start = len(prompt) - 1
        hits += int((guess[start:] == ids[0, start + 2:]).sum())
        total += len(guess[start:])
    # A trained head agrees far above chance (1 in the vocabulary's 5,376): drafts get accepted.
    assert hits / total > 0.05, (hits, total)


def test_real_engine_serves_tiny_mimo_token_exact_without_mtp(mimo: Path, tmp_path: Path
                                                               ) -> None:
    require_sglang()
    from workers.generate.context import stop_token_ids
    from workers.generate.engines.base import GenRequest
    from workers.generate.engines.cpu import CpuEngine
    from workers.generate.engines.sglang import SglangEngine

    greedy = Sampling(max_new_tokens=GREEDY_TOKENS, temperature=0.0)
    requests = [GenRequest(ids, greedy) for ids in _prompts(mimo, 3)]
    with real_server(mimo, tmp_path, free_port()) as url:
        engine = SglangEngine(url, None, max_in_flight=4, request_timeout=600, retry_window=60,
                              stop_ids=stop_token_ids(mimo))

        async def served() -> list[Any]:
            return await asyncio.gather(*(engine.generate(r) for r in requests))

        real = asyncio.run(served())
    cpu = CpuEngine(mimo, batch_size=1)

    async def reference() -> list[Any]:
        return [await cpu.generate(r) for r in requests]

    for mine, theirs in zip(asyncio.run(reference()), real, strict=True):
        assert theirs.output_ids == mine.output_ids and len(theirs.output_ids) > 1


def _run(pipeline: Pipeline, mimo: Path, src: str, on: bool
         ) -> tuple[dict[str, list[list[int]]], str | None]:
    """One run of ``src`` by a worker of its own with MTP on or off: the output ids it stored
    per sample, and the speculative algorithm its SGLang server reports it runs."""
    run = f"mtp-{'on' if on else 'off'}"
    open_gates = [arg for gate in ("truncated", "thinking", "empty_answer", "leakage",
                                   "duplicates") for arg in ("--skip-gate", gate)]
    pipeline.cli("enqueue", "--input", src, "--run", run, "--model", TINY_MIMO,
                 "--shard-size", "3", "--max-new-tokens", str(GREEDY_TOKENS),
                 "--temperature", "0", "--min-supervised-tokens", "0", *open_gates, check=True)
    port = free_port()
    args, env = mtp_worker_args(mimo, port, on)
    worker = pipeline.start_worker(run, "--engine", "sglang", "--max-in-flight", "4", *args,
                                   **env)
    pipeline.wait_done(run, timeout=1200)
    algorithm = call_json(f"http://127.0.0.1:{port}/get_server_info")[1]["speculative_algorithm"]
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=120)
    samples = _committed_samples(pipeline.env["DFLASH_STORAGE"], run)
    return {s["id"]: [turn["output_ids"] for turn in s["turns"]] for s in samples}, algorithm


def test_worker_with_mtp_stores_what_it_stores_without(pipeline: Pipeline, mimo: Path,
                                                       tmp_path: Path) -> None:
    require_sglang()
    refusal = mtp_refusal(mimo, tmp_path / "probe")
    if refusal is not None:
        pytest.skip(f"the pinned SGLang does not serve NEXTN on the CPU here: {refusal}")
    rows = _mt_bench_rows(6)
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    off, plain = _run(pipeline, mimo, src, on=False)
    on, drafting = _run(pipeline, mimo, src, on=True)
    assert plain is None and drafting, (plain, drafting)   # NEXTN runs as SGLang's EAGLE
    assert sorted(off) == sorted(str(r["question_id"]) for r in rows)
    assert on == off                                     # token for token, every turn
    assert sum(len(ids) for turns in off.values() for ids in turns) > 2 * len(rows)
