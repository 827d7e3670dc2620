"""MTP decided per run (issue 60): lossless for every sampler or refused, the bench's verdict
stored under the run and followed by ``--mtp auto``, the head checked in the weights, engine
arguments passed as written, the bench's steady window, and the projection's winner.

Pure functions and a local directory as storage; the end-to-end runs are in
tests/test_mtp_e2e.py and tests/test_bench_run.py.
"""

from __future__ import annotations

import ast
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

from common.choices import MtpMode, MtpSource
from common.config import load_settings
from common.engine.lossless import (
    ARGMAX_PLATFORMS,
    GREEDY_SOURCE,
    engine_platform,
    lossless_refusal,
)
from common.engine.mtp import MtpWorker, choose_mtp, decide_mtp
from common.engine.sampling import Sampling
from common.engine.serving import engine_command
from common.engine.target import TargetShape
from common.errors import ConfigError
from common.reads import foreign_counts, forget_foreign
from common.runs.bench_verdict import Decider, read_verdict, write_verdict
from common.storage import LocalStorage
from producer.bench import BenchRow, Sent, steady_row
from producer.projection import project
from tests.sglang_real import require_sglang
from tests.test_serving_lines import qwen36

SAMPLED = Sampling(temperature=0.6, top_p=0.95, top_k=20)
NO_ROCM = Path("/nonexistent-rocm")


def sglang(**values: object):  # noqa: ANN201
    return load_settings({}, engine="sglang", **values)


def worker(mode: str = "auto", **values: object) -> MtpWorker:
    return MtpWorker.of(sglang(mtp=mode, **values), qwen36(), env={})


# -- lossless for every sampler, or refused ---------------------------------------------------

def test_every_parameter_the_verify_does_not_keep_is_named() -> None:
    assert lossless_refusal("NEXTN", "cuda", SAMPLED) is None   # rejection sampling: exact
    cases = [(Sampling(min_p=0.05), "min_p 0.05"),
             (Sampling(presence_penalty=1.5), "presence_penalty 1.5"),
             (Sampling(repetition_penalty=1.1), "repetition_penalty 1.1"),
             (Sampling(temperature=0, presence_penalty=0.5), "presence_penalty 0.5")]
    for sampling, named in cases:
        refusal = lossless_refusal("NEXTN", "cuda", sampling)
        assert refusal is not None and named in refusal and "eagle_utils.py" in refusal
    # Greedy keeps the argmax whatever min-p; the argmax platforms refuse sampling only.
    assert lossless_refusal("NEXTN", "cuda", Sampling(temperature=0, min_p=0.05)) is None
    for platform in ("cpu", "xpu", "hip"):
        assert "_verify_uses_greedy" in lossless_refusal("NEXTN", platform, SAMPLED)
        assert lossless_refusal("NEXTN", platform, Sampling(temperature=0)) is None
    assert "--speculative-accept-threshold-single 0.5" in lossless_refusal(
        "NEXTN", "cuda", SAMPLED, "--speculative-accept-threshold-single 0.5")
    assert "SGLANG_SIMULATE_ACC_LEN" in lossless_refusal(
        "EAGLE", "cuda", SAMPLED, "", {"SGLANG_SIMULATE_ACC_LEN": "3"})
    assert lossless_refusal(None, "cpu", Sampling(min_p=0.5)) is None   # nothing drafts
    assert lossless_refusal("NEXTN", "npu", SAMPLED) is None   # a sampled verify (below)


def test_the_argmax_platforms_are_the_pinned_sglangs() -> None:
    """The platforms refused for sampling are those whose verify the pinned SGLang makes
    commit the argmax; an Ascend NPU samples through sgl_kernel_npu, as CUDA does."""
    found = subprocess.run([str(require_sglang()), "-c", "import importlib.util as u; "
                            "print(u.find_spec('sglang').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True, timeout=120)
    root = Path(found.stdout.strip())
    path, line = GREEDY_SOURCE.split()[0].split(":")
    tree = ast.parse((root.parent / path).read_text())
    greedy = next(n for n in ast.walk(tree)
                  if isinstance(n, ast.FunctionDef) and n.name == "_verify_uses_greedy")
    assert greedy.lineno == int(line)
    returned = next(n for n in ast.walk(greedy) if isinstance(n, ast.Return))
    flags = {n.id for n in ast.walk(returned) if isinstance(n, ast.Name)}
    assert {f.removeprefix("is_") for f in flags if f.startswith("is_") and f != "is_all_greedy"} \
        == set(ARGMAX_PLATFORMS) == {"cpu", "xpu", "hip"}
    kernels = (root / "kernels/ops/speculative/verify_sampling.py").read_text().splitlines()
    assert kernels[7] == "if is_npu():" and "sgl_kernel_npu.sample" in kernels[9]
    assert kernels[11].strip() == "tree_speculative_sampling_target_only,"


def test_the_platform_is_the_one_sglang_will_use() -> None:
    assert engine_platform("", {}, NO_ROCM) == "cuda"
    assert engine_platform("", {"SGLANG_USE_CPU_ENGINE": "1"}, NO_ROCM) == "cpu"
    assert engine_platform("--device=xpu", {}, NO_ROCM) == "xpu"
    assert engine_platform("--device cpu", {}, NO_ROCM) == "cpu"
    assert engine_platform("", {"HIP_VISIBLE_DEVICES": "0"}, NO_ROCM) == "hip"
    assert engine_platform("--speculative-use-rejection-sampling", {"ROCR_VISIBLE_DEVICES": "0"},
                           NO_ROCM) == "cuda"   # ROCm's Triton rejection sampler: exact


# -- the per-run decision ---------------------------------------------------------------------

def _verdict(tmp_path: Path, rates: dict[int, tuple[float, float]]):  # noqa: ANN202
    storage = LocalStorage(str(tmp_path))
    decider = Decider("NVIDIA H100 80GB HBM3", 1, "0123abcd")
    rows = [{"mtp": mode, "concurrency": c, "output_tokens_per_s": rate, "steady": True,
             "window_rates": [rate, rate]}   # steady, two windows alike: a clear winner
            for c, (off, on) in rates.items() for mode, rate in (("off", off), ("on", on))]
    key, _ = write_verdict(storage, "r", decider, rows)
    assert key.startswith("runs/r/bench/nvidia-h100-80gb-hbm3-tp1-0123abcd/verdict-")
    return read_verdict(storage, "r", decider)


def test_a_near_tie_keeps_the_running_configuration(tmp_path: Path) -> None:
    """A verdict within the margin (2% apart) names no winner: the decision keeps what the
    engine runs, either way, and says so."""
    verdict = _verdict(tmp_path, {16: (1000.0, 1020.0)})
    kept = [decide_mtp(worker(), "r", SAMPLED, verdict, 16, "", {}, running=running)
            for running in (False, True)]
    assert [c.on for c in kept] == [False, True]
    assert all("no clear winner" in c.reason and c.source is MtpSource.BENCH for c in kept)
    clear = _verdict(tmp_path / "clear", {16: (1000.0, 1200.0)})
    assert decide_mtp(worker(), "r", SAMPLED, clear, 16, "", {}, running=False).on


def test_auto_follows_the_runs_verdict_at_the_nearest_concurrency(tmp_path: Path) -> None:
    verdict = _verdict(tmp_path, {16: (900.0, 2000.0), 256: (4000.0, 3000.0)})
    low = decide_mtp(worker(), "r", SAMPLED, verdict, 32, "", {})
    assert low.on and low.args and "at concurrency 16: mtp on 2,000.0 vs off 900.0" in low.reason
    high = decide_mtp(worker(), "r", SAMPLED, verdict, 200, "", {})
    assert not high.on and not high.args and "mtp on is not faster" in high.line()
    assert low.source is high.source is MtpSource.BENCH
    none = decide_mtp(worker(), "r", SAMPLED, None, 128, "", {})   # measured: on first
    assert none.on and none.reason.startswith("no bench verdict for this worker: measuring")
    assert none.source is MtpSource.MEASURED and none.rates is None
    # on and off decide without the verdict; a worker without a head is off whatever it says
    forced = [decide_mtp(worker(mode), "r", SAMPLED, verdict, 32, "", {}) for mode in ("on", "off")]
    assert [(c.on, c.source, c.mode) for c in forced] == [
        (True, MtpSource.FORCED, MtpMode.ON), (False, MtpSource.FORCED, MtpMode.OFF)]
    dense = MtpWorker.of(sglang(), None, env={})
    headless = decide_mtp(dense, "r", SAMPLED, verdict, 32, "", {})
    assert not headless.on and headless.source is MtpSource.NO_HEAD


def test_a_sampling_the_verify_changes_parks_under_on_and_runs_plain_under_auto() -> None:
    minp = Sampling(min_p=0.05)
    with pytest.raises(ConfigError, match="run r: --mtp on: .*min_p 0.05"):
        decide_mtp(worker("on"), "r", minp, None, 128, "", {})
    auto = decide_mtp(worker(), "r", minp, None, 128, "", {})
    assert not auto.on and "min_p 0.05" in auto.reason and auto.reason.startswith("the run's")
    assert auto.source is MtpSource.SAMPLING
    own = MtpWorker.of(sglang(engine_args="--speculative-algorithm EAGLE3"), qwen36(), env={})
    with pytest.raises(ConfigError, match="presence_penalty"):
        decide_mtp(own, "r", Sampling(presence_penalty=0.5), None, 8, "", {})


def test_a_verdict_holds_for_its_hardware_and_engine_only(tmp_path: Path) -> None:
    forget_foreign()
    storage = LocalStorage(str(tmp_path))
    here = Decider.of(sglang(engine_cmd="sim {engine_args}"), 0, {"SGLANG_USE_CPU_ENGINE": "1"})
    other = Decider.of(sglang(engine_cmd="sim {engine_args} --seed 1"), 0,
                       {"SGLANG_USE_CPU_ENGINE": "1"})
    assert here.gpu == "cpu" and here.key != other.key
    rows = [{"mtp": mode, "concurrency": 8, "output_tokens_per_s": rate, "steady": True,
             "window_rates": [rate, rate]} for mode, rate in (("off", 10.0), ("on", 20.0))]
    key, _ = write_verdict(storage, "r", here, rows)
    assert read_verdict(storage, "r", other) is None
    assert write_verdict(storage, "r", here, rows[:1]) is None   # nothing to decide: not stored
    # A newer object that is no verdict is passed over for the newest that is one.
    forged = key.replace("verdict-", "verdict-zz")
    assert storage.put_once(forged, b'{"run": "r", "rows": "many"}')
    os.utime(storage.path / forged, (os.path.getmtime(storage.path / key) + 5,) * 2)
    found = read_verdict(storage, "r", here)
    assert found is not None and found.at(8).on and foreign_counts() == {"bench": 1}


# -- the head in the weights, engine arguments as written ---------------------------------------

def _safetensors(path: Path, names: list[str]) -> None:
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
                         for n in names}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


def test_a_head_the_config_states_must_be_in_the_weights(tmp_path: Path) -> None:
    config = json.loads((Path(__file__).parents[1] / "benchmarks" / "shapes" /
                         "qwen3.6-27b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert TargetShape.from_dir(tmp_path).has_mtp   # config only: the config decides
    _safetensors(tmp_path / "model.safetensors", ["model.layers.0.mlp.up_proj.weight"])
    shape = TargetShape.from_dir(tmp_path)
    assert not shape.has_mtp and "model.safetensors" in shape.mtp_missing
    choice = choose_mtp(sglang(), shape, env={})
    assert not choice.on and "weights hold none" in choice.reason
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {"mtp.fc.weight": "model-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert TargetShape.from_dir(tmp_path).has_mtp
    layers = shape.num_layers   # DeepSeek-V3 / GLM-4.5: the head is a layer past the last
    index = {"weight_map": {f"model.layers.{layers}.eh_proj.weight": "m.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert TargetShape.from_dir(tmp_path).has_mtp


def test_engine_arguments_pass_as_written_and_tuning_flags_keep_auto() -> None:
    quoted = "--json-model-override-args '{\"rope_scaling\": {\"factor\": 2}}' --x {port}"
    argv = engine_command(sglang(engine_args=quoted, engine_port=31001), Path("/m"))
    assert argv[argv.index("--json-model-override-args") + 1] == \
        '{"rope_scaling": {"factor": 2}}'   # str.format would have raised KeyError
    assert argv[argv.index("--x") + 1] == "31001"   # the fields are still filled
    tuned = choose_mtp(sglang(engine_args="--speculative-num-steps 2"), qwen36(), env={})
    assert tuned.on and tuned.algorithm == "NEXTN"
    argv = engine_command(sglang(engine_args="--speculative-num-steps 2"), Path("/m"), tuned.args)
    steps = [argv[i + 1] for i, a in enumerate(argv) if a == "--speculative-num-steps"]
    assert steps == ["3", "2"]   # ours, then the user's: SGLang takes the last


# -- the bench's window and the projection ----------------------------------------------------

def test_the_rate_is_taken_over_the_steady_window() -> None:
    # Two slots: the first wave (0-10 s, both) is warm-up; the drain after the last send (40 s)
    # runs at a batch of one. Inside [10, 40]: 2 requests in flight, 100 tokens/s each.
    sent = [Sent(0, 10, 1000), Sent(0, 10, 1000), Sent(10, 20, 1000), Sent(10, 30, 2000),
            Sent(20, 40, 2000), Sent(30, 40, 1000), Sent(40, 50, 1000)]
    row = steady_row(sent, 2)
    assert row.steady and row.window == (10, 40)
    assert row.output_tokens == 6000 and row.tokens_per_s == pytest.approx(200.0)
    assert row.total_tokens == 9000 and row.window_requests == 4
    few = steady_row(sent[:2], 2)   # nothing past the first wave: the whole span, said so
    assert not few.steady and few.window == (0, 10) and few.tokens_per_s == 200.0


def test_with_nothing_left_the_faster_configuration_is_best() -> None:
    rows = [BenchRow(8, 10, 1000, 10.0, 1, 1, mtp="off"), BenchRow(8, 10, 2000, 10.0, 1, 1,
                                                                   mtp="on")]
    done = project(rows, 0, (100, 300_000), 1.0, gpus=1)
    assert done.hours == {"off": 0.0, "on": 0.0} and done.best == "on"
    slower = project([rows[0], BenchRow(8, 10, 500, 10.0, 1, 1, mtp="on")], 0, (1, 1), 1.0, 1)
    assert slower.best == "off"
