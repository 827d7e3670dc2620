"""The worker's MTP choice (``--mtp auto|on|off``), lossless or refused, the engine line it
builds (``{engine_args}`` in ``--engine-cmd`` too) and the speculative figures it keeps.

Pure functions of settings and a target's config; the CLI's refusals run the real command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_settings
from common.engine.lossless import lossless_refusal
from common.engine.mtp import choose_mtp, hybrid_spec_args
from common.engine.sampling import Sampling
from common.engine.serving import engine_command, mamba_spec_states_per_request, mtp_engine_args
from common.engine.speculative import by_worker, sample_totals, spec_figures
from common.engine.target import TargetShape
from common.errors import ConfigError, OptionRefused
from tests.conftest import ROOT
from tests.test_serving_lines import DENSE, assert_known, qwen36
from workers.generate.engines.base import GenRequest
from workers.generate.engines.sglang import parse_response

NEXTN = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
HYBRID_EXTRA = ["--mamba-radix-cache-strategy", "extra_buffer"]
SIM = f"{sys.executable} -m embedded.simulator --port {{port}} --model-path {{model}}"


def sglang(**values: object):  # noqa: ANN201
    return load_settings({}, engine="sglang", **values)


def test_auto_is_on_for_a_head_on_the_gpu_with_what_a_hybrid_needs() -> None:
    choice = choose_mtp(sglang(), qwen36())
    assert choice.on and choice.algorithm == "NEXTN" and choice.device == "cuda"
    assert list(choice.args) == NEXTN + HYBRID_EXTRA
    assert choice.line().startswith("mtp on (auto): the target states an MTP head, SGLang on "
                                    "the GPU: NEXTN, 3 steps, top-1, 4 tokens verified")
    argv = engine_command(sglang(max_in_flight=96), Path("/m"), choice.args)
    assert argv[argv.index("--max-running-requests") + 1] == "96"   # SGLang caps it at 48
    assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    assert_known(argv)
    # extra_buffer: 3 + 2 state slots per running request, and 4 draft states while verifying
    assert mamba_spec_states_per_request(argv) == 4


def test_auto_is_off_without_a_head_or_a_gpu_engine_and_says_why() -> None:
    dense = TargetShape.from_dict(DENSE)
    cases = [(sglang(), dense, "the target states no MTP head"),
             (sglang(), None, "the target states no MTP head"),
             (load_settings({}), qwen36(), "the CPU engine has no speculative decoding"),
             (sglang(engine_url="http://h:1"), qwen36(), "runs with the flags it was started"),
             (sglang(engine_cmd=SIM), qwen36(), "no {engine_args} field"),
             (sglang(engine_args="--device cpu"), qwen36(), "_verify_uses_greedy"),
             (sglang(mtp="off"), qwen36(), "asked off")]
    for settings, shape, why in cases:
        choice = choose_mtp(settings, shape)
        assert not choice.on and not choice.args and why in choice.line(), choice.line()
    # A hybrid's own strategy, or no radix cache, is left as the user wrote it.
    assert hybrid_spec_args(qwen36(), "--mamba-radix-cache-strategy no_buffer") == []
    assert hybrid_spec_args(qwen36(), "--disable-radix-cache") == []
    assert hybrid_spec_args(TargetShape.from_dict(DENSE), "") == []


def test_on_where_it_cannot_run_is_refused_and_the_users_flags_win() -> None:
    for settings, shape in [(sglang(mtp="on"), TargetShape.from_dict(DENSE)),
                            (load_settings({}, mtp="on"), qwen36()),
                            (sglang(mtp="on", engine_url="http://h:1"), qwen36()),
                            (sglang(mtp="on", engine_cmd=SIM), qwen36())]:
        with pytest.raises(OptionRefused, match="^--mtp on: "):
            choose_mtp(settings, shape)
    with pytest.raises(OptionRefused, match="--mamba-track-interval 2"):
        choose_mtp(sglang(engine_args="--mamba-track-interval 2"), qwen36())
    on_cpu = choose_mtp(sglang(mtp="on", engine_args="--device cpu"), qwen36())
    assert on_cpu.on and on_cpu.device == "cpu" and "greedy runs only" in on_cpu.line()
    own = choose_mtp(sglang(mtp="on", engine_args="--speculative-algorithm EAGLE3 "
                                               "--speculative-draft-model-path /d"), qwen36())
    assert not own.on and not own.args and own.algorithm == "EAGLE3"
    assert "the user's speculative flags win" in own.line()


def test_sampling_through_mtp_on_the_cpu_is_refused_greedy_is_not() -> None:
    sampled, greedy = Sampling(temperature=0.6), Sampling(temperature=0.0)
    refusal = lossless_refusal("NEXTN", "cpu", sampled)
    assert refusal and "eagle_utils.py:485 _verify_uses_greedy" in refusal
    assert lossless_refusal("NEXTN", "cpu", greedy) is None
    assert lossless_refusal("NEXTN", "cpu", Sampling(temperature=0.7, top_k=1)) is None
    assert lossless_refusal("NEXTN", "cuda", sampled) is None   # rejection sampling on the GPU
    assert lossless_refusal(None, "cpu", sampled) is None


def test_engine_cmd_gets_the_flags_sglang_would() -> None:
    mtp = mtp_engine_args(qwen36())
    settings = sglang(engine_cmd=SIM + " {engine_args} --seed 7", engine_args="--context-length "
                      "{port}", max_in_flight=12, engine_port=31000)
    argv = engine_command(settings, Path("/m"), mtp)
    tail = argv[argv.index("/m") + 1:]
    assert tail == [*mtp, "--context-length", "31000", "--max-running-requests", "12",
                    "--seed", "7"]
    joined = engine_command(sglang(engine_cmd="run '--flags={engine_args}'"), Path("/m"))
    assert joined == ["run", "--flags="]
    plain = engine_command(sglang(engine_cmd=SIM + " {engine_args}"), Path("/m"))
    assert plain[-1] == "/m", "no flags: nothing spliced in"


def test_a_turn_keeps_sglangs_spec_figures_and_status_adds_them_up() -> None:
    meta = {"finish_reason": {"type": "stop"}, "prompt_tokens": 2, "completion_tokens": 6,
            "spec_verify_ct": 3, "spec_accept_length": 2.0, "spec_accept_rate": 0.33,
            "spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 9}
    result = parse_response({"output_ids": [5] * 6, "meta_info": meta},
                            GenRequest([1, 2], Sampling()), 0.1)
    assert result.speculative == {k: v for k, v in meta.items() if k.startswith("spec_")}
    plain = parse_response({"output_ids": [5], "meta_info": {"completion_tokens": 1,
                                                             "finish_reason": "stop"}},
                           GenRequest([1, 2], Sampling()), 0.1)
    assert plain.speculative is None and spec_figures({"id": "x"}) is None
    samples = [{"turns": [{"completion_tokens": 6, "speculative": {"spec_verify_ct": 3}},
                          {"completion_tokens": 9}]},
               {"turns": [{"completion_tokens": 10, "speculative": {"spec_verify_ct": 4}}]}]
    assert sample_totals(samples) == (7, 16)
    raw = {"verify_steps:w1@h": "7", "output_tokens:w1@h": "16", "algorithm:w1@h": "NEXTN",
           "verify_steps:w2@h": "0", "output_tokens:w2@h": "0", "noise": "1"}
    assert by_worker(raw) == {
        "w1@h": {"algorithm": "NEXTN", "verify_steps": 7, "output_tokens": 16,
                 "accept_length": round(16 / 7, 3)},
        "w2@h": {"algorithm": None, "verify_steps": 0, "output_tokens": 0,
                 "accept_length": None}}


def _worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "worker", "generate", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**_env(), **(env or {})})


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_worker_refuses_mtp_where_it_cannot_run_with_one_line(tmp_path: Path) -> None:
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(DENSE))
    for args in (["--engine", "sglang", "--mtp", "on"], ["--engine", "cpu", "--mtp", "on"],
                 ["--engine", "sglang", "--engine-url", "http://127.0.0.1:1", "--mtp", "on"]):
        result = _worker(*args, env={"DFLASH_STORAGE": str(tmp_path / "s"),
                                     "DFLASH_MODEL": str(dense)})
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith("error: --mtp on: "), lines
    bad = _worker("--mtp", "sometimes")
    assert bad.returncode == 2 and "sometimes" in bad.stderr
    env = _worker(env={"DFLASH_MTP": "maybe"})
    assert env.returncode == 2 and "maybe" in env.stderr
    with pytest.raises(ConfigError, match="DFLASH_MTP='maybe' is not one of auto, on, off"):
        load_settings({"DFLASH_MTP": "maybe"})
