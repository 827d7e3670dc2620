"""One prepared check of the CUDA paths on a randomly initialised target: dense or hybrid.

Run on a GPU host (nothing is downloaded; about 2-4 minutes on one H100/H200, < 8 by design):
``python benchmarks/gpu_check.py`` (dense Qwen3-8B) and ``python benchmarks/gpu_check.py
--target qwen3.6-27b`` (hybrid); the test suite's smoke runs add ``--device cpu --tiny`` (the
tiny twins' dims, float32, seconds).

The dense target is built from a ``Qwen3Config`` with Qwen3-8B's dims (hidden 4096, 36 layers,
32 heads, 8 KV heads, head_dim 128, intermediate 12288, vocab 151936), the hybrid one from
Qwen3.6-27B's ``text_config`` (``benchmarks/gpu_targets.py``: hidden 5120, Gated DeltaNet and
gated attention 3:1, vocab 248320; 16 of its 64 layers by default, ``--layers``), directly on
the device in bf16; for the hybrid a last row names the Gated DeltaNet kernels that ran (flash-
linear-attention / causal-conv1d when installed, else torch's fallback). Then: (a) hidden-state
extraction (``HiddenExtractor`` on that model) tokens/s and peak memory at 2K and 4K tokens; (b)
the drafter training step with flex_attention (compiled on CUDA) versus the dense SDPA mask: the
loss of one batch from identical weights must agree to bf16 tolerance, then tokens/s and peak
memory of each; (c) the speculative-decoding eval loop (a random drafter) against plain greedy
decoding: decode tokens/s and the same tokens; (d) the block masks' numerics: dense SDPA and
flex attention on CUDA (fp32 and bf16) against dense SDPA on the CPU in fp32 (CPU only: flex
eager against dense); (f) the training memory plan (:mod:`common.plan.memory`) beside what a
step really allocated, term by term (``benchmarks/training_memory.py``; on a GPU also the
target's weights, the drafter's state, flex's mask build and the runtime). Prints one table;
exits 1 on a numerics mismatch (or non-finite hidden states). Peak memory is
``torch.cuda.max_memory_allocated`` above what was resident before the part (the target's
weights), timings synchronise the device first; on the CPU both read "-" (but in (f), where the
CPU's figure is the live tensors' bytes, counted op by op).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gpu_targets import (  # noqa: E402
    DENSE,
    HYBRID,
    TARGETS,
    build_target,
    describe,
    linear_attention_kernels,
)
from benchmarks.training_memory import peak, plan_checks  # noqa: E402
from common.errors import HiddenStateError  # noqa: E402
from common.exit_codes import EXIT_FAILURE  # noqa: E402
from common.plan.memory import (  # noqa: E402
    Device,
    Micro,
    StepMemory,
    drafter_state_bytes,
    mask_build_bytes,
    target_bytes,
)
from common.plan.shapes import DrafterDims, TargetDims  # noqa: E402
from common.runs.trainrows import TrainingRow  # noqa: E402
from workers.batching import length_batches  # noqa: E402
from workers.devices import resolve_device  # noqa: E402
from workers.hidden.extraction import ExtractorConfig, HiddenExtractor  # noqa: E402
from workers.train.drafter.features import with_target_features  # noqa: E402
from workers.train.drafter.masks import dense_block_mask, flex_block_mask  # noqa: E402
from workers.train.drafter.model import DFlashConfig, DFlashDraftModel  # noqa: E402
from workers.train.drafter.train import DrafterTrainer, TrainConfig  # noqa: E402

GIB = 1024**3


@dataclass(frozen=True)
class Row:
    part: str
    case: str
    tokens_per_s: float | None
    peak_gib: float | None
    check: str
    ok: bool = True


class Meter:
    """Wall time after a device sync, and peak device memory above what was resident."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> Meter:
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sync()
        self.seconds = time.perf_counter() - self.started
        self.peak = ((torch.cuda.max_memory_allocated(self.device) - self.base) / GIB
                     if self.device.type == "cuda" else None)


def random_rows(count: int, length: int, vocab: int, seed: int) -> list[TrainingRow]:
    """Rows of random ids (the mask id, ``vocab - 1``, never among them), answer = last 3/4."""
    gen = torch.Generator().manual_seed(seed)
    prompt = length // 4
    return [TrainingRow(f"r{i}", 0, torch.randint(0, vocab - 1, (length,), generator=gen).tolist(),
                        [0] * prompt + [1] * (length - prompt)) for i in range(count)]


def part_extraction(target: Any, device: torch.device, lengths: list[int],
                    batch_tokens: int) -> list[Row]:
    """(a) HiddenExtractor tokens/s and peak memory, two full batches per length."""
    extractor = HiddenExtractor(ExtractorConfig("random-target", device=str(device)), model=target)
    rows = []
    for length in lengths:
        per_batch = max(1, batch_tokens // length)
        batches, _ = length_batches(random_rows(2 * per_batch, length, target.config.vocab_size,
                                                length), max_tokens=batch_tokens)
        case = f"{length} tok x {per_batch} rows, layers {extractor.layer_ids}"
        try:
            extractor.extract(batches[0])   # warm-up: kernels, allocator
            with Meter(device) as meter:
                for batch in batches:
                    extractor.extract(batch)
        except HiddenStateError as exc:
            rows.append(Row("a extraction", case, None, None, f"FAILED: {exc}", ok=False))
            continue
        tokens = sum(len(r.input_ids) for b in batches for r in b)
        rows.append(Row("a extraction", case, tokens / meter.seconds, meter.peak,
                        "finite, shapes and ids checked"))
    return rows


def part_training(target: Any, device: torch.device, rows_per_step: int,
                  length: int, anchors: int, steps: int) -> list[Row]:
    """(b) flex vs dense SDPA: same loss from the same weights and batch, then step speed."""
    mask_id = target.config.vocab_size - 1
    layer_ids = DFlashConfig.from_target(target.config, mask_id).target_layer_ids
    featured = with_target_features(target, random_rows(rows_per_step, length,
                                                        target.config.vocab_size, 1), layer_ids)
    tol = 2e-2 if device.type == "cuda" else 1e-4   # bf16 autocast on CUDA, float32 on the CPU
    results: dict[str, tuple[float | None, Row]] = {}
    for attention in ("sdpa", "flex"):
        label = {"sdpa": "dense SDPA mask",
                 "flex": "flex_attention " + ("compiled" if device.type == "cuda" else "eager")}
        case = (f"{label[attention]}, {rows_per_step} x {length} tok, {anchors} anchors/row"
                + ("" if device.type == "cuda" else ", forward only"))
        trainer = DrafterTrainer(DFlashDraftModel.for_target(target, mask_id, init_seed=0),
                                 TrainConfig(total_steps=steps + 2, max_anchors=anchors,
                                             attention=attention))
        try:
            batch, _ = trainer.prepare(featured, torch.Generator().manual_seed(0))
            assert batch is not None
            with torch.no_grad():
                loss = float(trainer.forward(batch)[0])
            # flex has no backward on the CPU: there both sides time the forward alone.
            timed = trainer.step if device.type == "cuda" else torch.no_grad()(
                lambda rows, t=trainer, b=batch: t.forward(b))
            timed(featured)                          # warm-up (and flex's compile)
            with Meter(device) as meter:
                for _ in range(steps):
                    timed(featured)
        except torch.cuda.OutOfMemoryError:
            results[attention] = (None, Row("b train step", case, None, None, "out of memory"))
        else:
            results[attention] = (loss, Row("b train step", case,
                                            steps * batch.tokens / meter.seconds, meter.peak,
                                            f"loss {loss:.5f}"))
        trainer = timed = None   # the bound step holds the trainer too: free both first
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (dense, dense_row), (flex, flex_row) = results["sdpa"], results["flex"]
    if dense is None or flex is None:
        return [dense_row, flex_row]
    close = math.isfinite(flex) and abs(flex - dense) <= tol * abs(dense)
    verdict = (f"loss {flex:.5f} vs dense {dense:.5f} (rel {abs(flex - dense) / abs(dense):.1e},"
               f" tol {tol:g})")
    return [dense_row, Row(flex_row.part, flex_row.case, flex_row.tokens_per_s,
                           flex_row.peak_gib, verdict, ok=close)]


def part_specdec(target: Any, device: torch.device, prompt_len: int,
                 new_tokens: int) -> list[Row]:
    """(c) the speculative-decoding eval loop (random drafter) vs plain greedy decoding."""
    from workers.train.drafter.specdec import (
        AcceptanceStats,
        DFlashProposer,
        greedy_generate,
        speculative_generate,
    )

    mask_id = target.config.vocab_size - 1
    drafter = DFlashDraftModel.for_target(target, mask_id, init_seed=0).eval()
    prompt = random_rows(1, prompt_len, target.config.vocab_size, 7)[0].input_ids
    layer_ids = drafter.config.target_layer_ids
    outs = {}
    rows = []
    for side in ("greedy", "speculative"):
        def run(s: str = side) -> object:
            if s == "greedy":
                return greedy_generate(target, prompt, new_tokens, set())
            return speculative_generate(target, DFlashProposer(drafter), prompt, layer_ids,
                                        new_tokens, set())
        try:
            run()                                  # warm-up
            with Meter(device) as meter:
                outs[side] = run()
        except Exception as exc:   # a loop that cannot run on this target is a finding
            rows.append(Row("c spec-decoding", f"{side}, {prompt_len}-tok prompt", None, None,
                            f"FAILED: {type(exc).__name__}: {exc}"[:160], ok=False))
            continue
        rows.append(Row("c spec-decoding", f"{side}, {prompt_len}-tok prompt, {new_tokens} new",
                        new_tokens / meter.seconds, meter.peak, "decode tokens/s"))
    if len(outs) < 2:
        return rows
    same = outs["greedy"].tokens == outs["speculative"].tokens
    tau = AcceptanceStats.of([outs["speculative"]], drafter.config.block_size).tau
    # bf16 on CUDA: a block verify and a one-token decode may round a near-tie differently.
    strict = device.type == "cpu"
    rows[-1] = Row(rows[-1].part, rows[-1].case, rows[-1].tokens_per_s, rows[-1].peak_gib,
                   f"tau {tau:.2f} (random drafter); tokens {'equal' if same else 'DIFFER'} "
                   f"to greedy" + ("" if strict else " (bf16: informational)"),
                   ok=same or not strict)
    return rows


def part_masks(device: torch.device) -> list[Row]:
    """(d) the block masks through dense SDPA and flex attention, against CPU fp32 dense."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(0)
    context, block = 96, 16
    anchors, starts = torch.tensor([5, 20, 40, 50, 70, 90]), torch.tensor([0, 0, 0, 48, 48, 48])
    q = torch.randn(1, 4, len(anchors) * block, 64, generator=gen)
    k, v = (torch.randn(1, 2, context + len(anchors) * block, 64, generator=gen) for _ in "kv")
    mask = dense_block_mask(anchors, starts, context, block)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def dense(dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
        m = dense_block_mask(anchors.to(dev), starts.to(dev), context, block)
        assert torch.equal(m.cpu(), mask), f"dense mask built on {dev} differs from the CPU's"
        return F.scaled_dot_product_attention(*(t.to(dev, dtype) for t in (q, k, v)),
                                              attn_mask=m, enable_gqa=True)

    def flex(dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
        run = torch.compile(flex_attention) if dev.type == "cuda" else flex_attention
        m = flex_block_mask(anchors.to(dev), starts.to(dev), context, block, dev)
        return run(*(t.to(dev, dtype) for t in (q, k, v)), block_mask=m, enable_gqa=True)

    cpu = torch.device("cpu")
    cases: list[tuple[str, Callable[[], torch.Tensor], float]] = [
        ("CPU flex eager fp32", lambda: flex(cpu, torch.float32), 1e-5)]
    if device.type == "cuda":
        for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 3e-2)):
            name = str(dtype).removeprefix("torch.")
            cases += [(f"CUDA dense SDPA {name}", lambda d=dtype: dense(device, d), tol),
                      (f"CUDA flex compiled {name}", lambda d=dtype: flex(device, d), tol)]
    rows = []
    for case, run, tol in cases:
        err = (run().float().cpu() - reference).abs().max().item()
        ok = math.isfinite(err) and err <= tol
        rows.append(Row("d mask numerics", f"{case} vs CPU dense fp32", None, None,
                        f"max abs err {err:.1e} (tol {tol:g})", ok=ok))
    return rows


def plan_row(term: str, measured: int, planned: int) -> Row:
    return Row("f memory plan", term, None, measured / GIB,
               f"planned {planned / GIB:.2f} GiB ({planned / max(measured, 1):.2f}x measured)")


def part_plan_terms(target: Any, device: torch.device, length: int, anchors: int) -> list[Row]:
    """(f) the plan's other terms (one rank, so no collective buffers) beside what the device
    holds: the target's weights; the drafter's state after an optimizer step (weights,
    gradients, moments: the allocator's bytes made since its build); flex's mask build (its
    peak); the runtime (the device's used memory that no tensor holds, after the step)."""
    dims, plan_device = TargetDims.of_model(target), Device(cuda=device.type == "cuda")
    weights = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in (*target.parameters(), *target.buffers())}
    rows = [plan_row("target weights", sum(weights.values()), target_bytes(dims))]
    mask_id = target.config.vocab_size - 1
    config = DFlashConfig.from_target(target.config, mask_id)
    featured = with_target_features(target, random_rows(1, length, target.config.vocab_size, 3),
                                    config.target_layer_ids)
    held: list[int] = []
    with peak(device) as read:
        trainer = DrafterTrainer(DFlashDraftModel.for_target(target, mask_id, init_seed=0),
                                 TrainConfig(total_steps=4, max_anchors=anchors))
        def after_step(*args: object) -> None:
            held.append(read()[1])

        trainer.optimizer.register_step_post_hook(after_step)
        trainer.step(featured)
    drafter = DrafterDims.from_config(trainer.drafter.config)
    rows.append(plan_row("drafter state", held[0], drafter_state_bytes(drafter, plan_device)))
    if device.type != "cuda":
        return rows
    batch, _ = trainer.prepare(featured, torch.Generator().manual_seed(0))
    assert batch is not None
    micro = Micro(1, length, length, batch.blocks * batch.block_size, int(batch.valid.sum()))
    with peak(device) as read:
        flex_block_mask(batch.anchors, batch.starts, batch.tokens, batch.block_size, device)
        built, _ = read()
    rows.append(plan_row(f"mask build, {micro.queries} queries", built,
                         mask_build_bytes(micro, plan_device)))
    free, total = torch.cuda.mem_get_info(device)
    step = StepMemory.of(dims, drafter, micro, plan_device, False)
    rows.append(plan_row("runtime (used, no tensor's)",
                         total - free - torch.cuda.memory_allocated(device), step.runtime))
    return rows


def render(rows: list[Row]) -> str:
    header = ("part", "case", "tokens/s", "peak GiB", "check", "ok")
    cells = [header] + [(r.part, r.case, f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
                         f"{r.peak_gib:.2f}" if r.peak_gib is not None else "-", r.check,
                         "ok" if r.ok else "MISMATCH") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cuda, cpu")
    parser.add_argument("--target", choices=TARGETS, default=DENSE,
                        help=f"target shape: dense {DENSE} or hybrid {HYBRID} [{DENSE}]")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"{HYBRID}: layers kept of 64, a multiple of 4 [16]")
    parser.add_argument("--tiny", action="store_true", help="the tiny model's dims (CPU smoke)")
    parser.add_argument("--lengths", default=None, help="extraction row lengths [2048,4096]")
    parser.add_argument("--batch-tokens", type=int, default=None, help="tokens per batch [16384]")
    parser.add_argument("--train-rows", type=int, default=2)
    parser.add_argument("--train-len", type=int, default=None, help="train row length [2048]")
    parser.add_argument("--anchors", type=int, default=None, help="anchors per row [128]")
    parser.add_argument("--steps", type=int, default=None, help="timed train steps [5]")
    args = parser.parse_args()
    # The CPU's flex is the eager reference on purpose; its "use torch.compile" advice is noise.
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    device = resolve_device(args.device, "--device")
    if device.type == "cpu" and not args.tiny:
        parser.error(f"the {args.target} shape needs a GPU; add --tiny for the CPU smoke run")
    small = args.tiny
    lengths = [int(n) for n in (args.lengths or ("256,512" if small else "2048,4096")).split(",")]
    try:
        target = build_target(args.target, args.tiny, device, args.layers)
    except ValueError as exc:
        parser.error(str(exc))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    params = sum(p.numel() for p in target.parameters()) / 1e9
    hybrid = args.target == HYBRID
    print(f"gpu_check on {name}: torch {torch.__version__}, target "
          f"{describe(args.target, args.tiny, args.layers)} ({params:.2f}B params, random, "
          f"{next(target.parameters()).dtype})"
          + (f"; Gated DeltaNet {linear_attention_kernels()}" if hybrid else ""), flush=True)
    rows = part_extraction(target, device, lengths,
                           args.batch_tokens or (2048 if small else 16384))
    rows += part_training(target, device, args.train_rows,
                          args.train_len or (256 if small else 2048),
                          args.anchors or (8 if small else 128), args.steps or (2 if small else 5))
    rows += part_specdec(target, device, 128 if small else 2048, 16 if small else 64)
    rows += part_masks(device)
    rows += [Row("f memory plan", case, None, measured / GIB,
                 f"planned {planned / GIB:.2f} GiB ({planned / max(measured, 1):.2f}x measured)")
             for case, measured, planned in plan_checks(target, lengths[:1],
                                                        args.anchors or (8 if small else 128))]
    if device.type == "cuda":
        rows += part_plan_terms(target, device, args.train_len or 2048, args.anchors or 128)
    if hybrid:
        rows.append(Row("e linear attention", linear_attention_kernels(), None, None,
                        "the kernels parts a-c ran"))
    print(render(rows))
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"{len(bad)} numerics mismatch(es): " + "; ".join(f"{r.part} {r.case}" for r in bad))
        sys.exit(EXIT_FAILURE)


if __name__ == "__main__":
    main()
