"""The serving lines (Qwen3.6 MTP generation, DFLASH on a hybrid) use only the pinned flags.

Every flag the command builder emits is held to ``workers/generate/engines/sglang_args_<pin>.txt``
(extracted from that release's ``server_args.py``); the mamba state cache warning is a pure
function, checked case by case. Run: ``pytest tests/test_serving_lines.py -q``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.config import load_settings
from common.serving import (
    dflash_engine_args,
    flags_of,
    launch_argv,
    mtp_engine_args,
    spec_settings,
)
from common.target import TargetShape
from producer.doctor.gpu_host import check_mamba_cache
from tests.conftest import ROOT
from tests.test_sglang_pin import pinned
from workers.generate.engines.server import server_command

QWEN36 = ROOT / "benchmarks" / "shapes" / "qwen3.6-27b.json"
DENSE = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
         "num_hidden_layers": 36, "vocab_size": 151936, "max_position_embeddings": 40960,
         "torch_dtype": "bfloat16"}


def known_flags() -> set[str]:
    path = ROOT / "workers" / "generate" / "engines" / f"sglang_args_{pinned()}.txt"
    lines = [line.strip() for line in path.read_text().splitlines()]
    return {line for line in lines if line and not line.startswith("#")}


def assert_known(argv: list[str]) -> None:
    unknown = sorted(set(flags_of(argv)) - known_flags())
    assert not unknown, f"not flags of sglang {pinned()}: {unknown}"


def qwen36() -> TargetShape:
    return TargetShape.from_dict(json.loads(QWEN36.read_text()))


def test_the_qwen36_shape_is_a_hybrid_with_an_mtp_head() -> None:
    shape = qwen36()
    assert (shape.num_layers, shape.hidden_size, shape.context_length) == (64, 5120, 262144)
    assert shape.is_hybrid and shape.has_mtp
    assert shape.full_attention_layers == list(range(3, 64, 4))   # 3 linear : 1 full


def test_mtp_generation_line_on_qwen36() -> None:
    extra = mtp_engine_args(qwen36(), max_running_requests=8)
    assert extra == ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                     "--max-running-requests", "8", "--max-mamba-cache-size", "40"]
    argv = launch_argv("/models/Qwen3.6-27B", port=30001, tp=2, mem_fraction_static="0.8",
                       engine_args=extra)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert_known(argv)
    with pytest.raises(ValueError, match="no MTP head"):
        mtp_engine_args(TargetShape.from_dict(DENSE))


def test_dflash_serving_line_on_a_hybrid_and_a_dense_target() -> None:
    hybrid = dflash_engine_args("/out/drafter", block_size=16, shape=qwen36(),
                                max_running_requests=8)
    assert hybrid == ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                      "/out/drafter", "--speculative-num-draft-tokens", "16",
                      "--max-running-requests", "8", "--max-mamba-cache-size", "136"]
    assert_known(launch_argv("/models/Qwen3.6-27B", engine_args=hybrid))
    # A dense target has no mamba cache to size: the line stays the plain DFLASH one.
    dense = dflash_engine_args("/out/drafter", shape=TargetShape.from_dict(DENSE),
                               max_running_requests=8)
    assert dense == hybrid[:6]


def test_the_workers_own_engine_line_uses_known_flags(tmp_path: Path) -> None:
    settings = load_settings({}, engine_args=shlex.join(mtp_engine_args(qwen36())),
                             tp=2, mem_fraction_static="0.85", gpu=1)
    argv = server_command(settings, tmp_path)
    assert argv[argv.index("--tp-size") + 1] == "2" and "--tp" not in argv
    assert argv[argv.index("--port") + 1] == str(settings.engine_port + 1)
    assert argv[-8:] == mtp_engine_args(qwen36())
    assert_known(argv)


def test_spec_settings_read_the_engine_args() -> None:
    spec = spec_settings("--speculative-algorithm dflash --speculative-dflash-block-size=8 "
                         "--max-running-requests 4 --max-mamba-cache-size 20 --trust-remote-code")
    assert (spec.algorithm, spec.draft_tokens, spec.max_running_requests,
            spec.max_mamba_cache_size) == ("DFLASH", 8, 4, 20)
    assert spec_settings("").algorithm is None


def test_mamba_cache_warning_cases() -> None:
    shape = qwen36()
    assert check_mamba_cache(TargetShape.from_dict(DENSE), "--speculative-algorithm DFLASH",
                             128) is None                         # no mamba state on a dense one
    assert check_mamba_cache(shape, "", 128) is None             # not serving DFLASH
    unset = check_mamba_cache(shape, "--speculative-algorithm DFLASH", 128, 16)
    assert unset is not None and unset.status == "WARN"
    assert "128 requests need 2176 mamba slots, 17 state slots per request" in unset.detail
    assert "--max-running-requests 128 --max-mamba-cache-size 2176" in unset.fix
    small = check_mamba_cache(shape, "--speculative-algorithm DFLASH --max-running-requests 8 "
                                     "--speculative-num-draft-tokens 4 --max-mamba-cache-size 10",
                              128)
    assert small is not None and small.status == "WARN"
    assert "caps DFLASH at 2 running requests of the 8 wanted" in small.detail
    assert "--max-mamba-cache-size 40" in small.fix
    enough = check_mamba_cache(shape, "--speculative-algorithm DFLASH --max-running-requests 8 "
                                      "--speculative-num-draft-tokens 4 "
                                      "--max-mamba-cache-size 40", 128)
    assert enough is not None and enough.status == "PASS"
    # A drafter to serve counts even before DFLASH_ENGINE_ARGS names the algorithm.
    drafter_only = check_mamba_cache(shape, "", 4, drafter_block_size=16)
    assert drafter_only is not None and "--max-mamba-cache-size 68" in drafter_only.fix


def serve(*args: str) -> tuple[int, str]:
    from producer.cli import main

    result = CliRunner().invoke(main, ["serve-command", *args], env={"DFLASH_MAX_IN_FLIGHT": "8"})
    return result.exit_code, result.output


def test_serve_command_prints_both_lines(tmp_path: Path) -> None:
    target = tmp_path / "qwen3.6"
    target.mkdir()
    (target / "config.json").write_text(QWEN36.read_text())
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 16,
                                                     "dflash_config": {"block_size": 16}}))
    code, out = serve("mtp", "--model", str(target), "--json")
    assert code == 0, out
    mtp = json.loads(out)
    assert mtp["engine_args"] == shlex.join(mtp_engine_args(qwen36(), max_running_requests=8))
    assert mtp["argv"][mtp["argv"].index("--model-path") + 1] == str(target)
    assert_known(mtp["argv"])

    code, out = serve("dflash", "--model", str(target), "--drafter", str(drafter), "--host",
                      "0.0.0.0")
    assert code == 0, out
    line, workers_line = out.splitlines()[:2]
    assert " --host 0.0.0.0 " in line
    assert "--speculative-algorithm DFLASH" in line and "--max-mamba-cache-size 136" in line
    assert_known(shlex.split(line))
    assert workers_line.startswith("# a generate worker starts the same engine with ")

    for args, message in ((["dflash", "--model", str(target)], "needs --drafter DIR"),
                          (["mtp", "--model", str(tmp_path / "none")], "is not there"),
                          (["dflash", "--model", str(target), "--drafter", str(tmp_path)],
                           "is not a drafter export")):
        code, out = serve(*args)
        assert code == 1 and "error: " in out and message in out, out


def test_mtp_on_a_dense_target_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    code, out = serve("mtp", "--model", str(tmp_path))
    assert code == 1
    assert out.strip().splitlines() == [f"error: {tmp_path}: the target states no MTP head "
                                        "(text_config.mtp_num_hidden_layers): NEXTN "
                                        "speculative decoding needs one"]

