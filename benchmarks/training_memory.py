"""A training step's peak memory against row length: today's capture and the K-layer capture side
by side, with the memory plan's figure beside each measured one.

Run: ``.venv/bin/python benchmarks/training_memory.py [--lengths 512,1024,2048,4096]`` (the
embedded tiny targets on the CPU, about a minute); ``benchmarks/gpu_check.py`` runs
:func:`measure_terms` on a GPU target, where the figures are ``torch.cuda.max_memory_allocated``.

For each target and length, one row of that length goes through a whole training step:

- *today*: the target's forward with ``output_hidden_states=True`` (every layer's states, kept
  until the K chosen ones are concatenated), then the drafter's forward and backward;
- *K layers*: the capture of :mod:`workers.capture` (the K layers only, the forward stopped
  after the deepest), then the same drafter step.

On the CPU "measured" is the most bytes live tensors held at once (:class:`LiveBytes`, op by op;
the target's and the drafter's weights and the gradients excluded: they are resident), on a GPU
the allocator's peak above what was allocated before. "plan" is :mod:`common.plan.memory` for the
same micro-batch: features + the larger of the target's forward and the drafter's step.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.plan.memory import Device, Micro, StepMemory  # noqa: E402
from common.plan.shapes import DrafterDims, TargetDims  # noqa: E402
from common.runs.trainrows import TrainingRow  # noqa: E402
from embedded.memtrack import LiveBytes  # noqa: E402
from workers.train.drafter.features import target_features  # noqa: E402
from workers.train.drafter.model import DFlashDraftModel  # noqa: E402
from workers.train.drafter.train import DrafterTrainer, TrainConfig  # noqa: E402

MIB = 2**20


@dataclass(frozen=True)
class Measured:
    """One step's bytes: the capture's peak, the features kept, the drafter step's peak."""

    capture_peak: int
    features: int
    drafter_peak: int

    @property
    def step_peak(self) -> int:
        return max(self.capture_peak, self.features + self.drafter_peak)


@contextmanager
def peak(device: torch.device) -> Iterator[Callable[[], tuple[int, int]]]:
    """``(peak, now)`` bytes above the start: live tensors on the CPU, the allocator on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: (torch.cuda.max_memory_allocated(device) - start,
                       torch.cuda.memory_allocated(device) - start)
        return
    with LiveBytes() as live:
        yield lambda: (live.peak, live.settle())


@torch.no_grad()
def todays_features(target: Any, row: TrainingRow, layers: tuple[int, ...]) -> torch.Tensor:
    """The capture before K-layer hooks: every layer's states, then the K concatenated."""
    device = target.get_input_embeddings().weight.device
    ids = torch.tensor([row.input_ids], device=device)
    out = target(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)[0]


def measure_step(target: Any, trainer: DrafterTrainer, row: TrainingRow,
                 today: bool) -> tuple[Measured, Micro]:
    """One row through the capture and the drafter's step; the bytes each held."""
    device = trainer.device
    layers = tuple(trainer.drafter.config.target_layer_ids)
    with peak(device) as read:
        features = (todays_features(target, row, layers) if today
                    else target_features(target, [row], layers)[0])
        capture_peak, kept = read()
    drawn, _ = trainer.draw([row], torch.Generator().manual_seed(0))
    trainer.featurize = lambda rows: [features]
    batch = trainer.pack(drawn)
    for p in trainer.drafter.parameters():
        p.grad = torch.zeros_like(p)   # resident: the drafter state's, not the step's
    with peak(device) as read:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = trainer.forward_sum(batch)
        loss.backward()
        drafter_peak, _ = read()
    micro = Micro(1, len(row.input_ids), len(row.input_ids), batch.blocks * batch.block_size,
                  int(batch.valid.sum()))
    return Measured(capture_peak, kept, drafter_peak), micro


def measure_terms(target: Any, lengths: list[int], anchors: int = 64,
                  checkpointing: bool = False) -> list[dict[str, Any]]:
    """Per length: today's and the K-layer step, measured, and the plan's figures."""
    device = target.get_input_embeddings().weight.device
    mask_id = target.get_input_embeddings().num_embeddings - 1
    drafter = DFlashDraftModel.for_target(target, mask_id, init_seed=0)
    drafter.checkpointing = checkpointing
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=4, max_anchors=anchors))
    trainer.checkpointing = lambda part: checkpointing
    dims = TargetDims.of_model(target)
    drafter_dims = DrafterDims.from_config(drafter.config)
    rows = []
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, mask_id, (length,), generator=gen).tolist()
        row = TrainingRow("r", 0, ids, [0] * (length // 4) + [1] * (length - length // 4))
        today, _ = measure_step(target, trainer, row, today=True)
        new, micro = measure_step(target, trainer, row, today=False)
        plan = StepMemory.of(dims, drafter_dims, micro, Device(cuda=device.type == "cuda"),
                             checkpointing)
        planned = plan.features + max(plan.target_transient, plan.drafter_activations)
        rows.append({"length": length, "today": today, "new": new, "plan": plan,
                     "planned_step": planned})
    return rows


def plan_checks(target: Any, lengths: list[int], anchors: int) -> list[tuple[str, int, int]]:
    """(what, measured bytes, planned bytes) per term and length, plain and checkpointed: what
    ``gpu_check.py`` prints, so that the first GPU run checks the plan."""
    checks = []
    for checkpointing in (False, True):
        for r in measure_terms(target, lengths, anchors, checkpointing):
            new, plan, n = r["new"], r["plan"], r["length"]
            if not checkpointing:
                checks += [(f"{n} tok features", new.features, plan.features),
                           (f"{n} tok target forward", new.capture_peak - new.features,
                            plan.target_transient)]
            checks.append((f"{n} tok drafter step, checkpointing {'on' if checkpointing else 'off'}"
                           f", {anchors} anchors", new.drafter_peak, plan.drafter_activations))
    return checks


def render(name: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{name}: one row of each length (MiB); capture = the target's forward and what it "
             "keeps, step = the whole training step",
             f"  {'tokens':>7} {'capture today':>13} {'capture K':>10} {'today/K':>8} "
             f"{'step today':>11} {'step K':>8} {'plan':>8} {'plan/meas':>9} | features "
             "meas/plan, target fwd meas/plan, drafter meas/plan"]
    for r in rows:
        today, new, plan = r["today"], r["new"], r["plan"]
        lines.append(
            f"  {r['length']:>7} {today.capture_peak / MIB:>13.1f} {new.capture_peak / MIB:>10.1f}"
            f" {today.capture_peak / new.capture_peak:>8.2f} {today.step_peak / MIB:>11.1f}"
            f" {new.step_peak / MIB:>8.1f} {r['planned_step'] / MIB:>8.1f}"
            f" {r['planned_step'] / new.step_peak:>9.2f} | {new.features / MIB:.1f}/"
            f"{plan.features / MIB:.1f}, {(new.capture_peak - new.features) / MIB:.1f}/"
            f"{plan.target_transient / MIB:.1f}, {new.drafter_peak / MIB:.1f}/"
            f"{plan.drafter_activations / MIB:.1f}")
    return lines


def at_the_users_shape(lengths: list[int]) -> list[str]:
    """What the two captures keep at Qwen3.6-27B's shape (bf16): every state or the K layers."""
    target = TargetDims.load(ROOT / "benchmarks" / "shapes" / "qwen3.6-27b.json")
    shape, width = target.shape, target.shape.hidden_size * target.dtype_bytes
    lines = ["Qwen3.6-27B (64 layers, hidden 5120, bf16): what the capture keeps per row (GiB)",
             f"  {'tokens':>7} {'today (65 states)':>18} {'K=5 layers':>11} {'today/K':>8}"]
    for n in lengths:
        today, kept = (shape.num_layers + 1) * n * width, 5 * n * width
        lines.append(f"  {n:>7} {today / 2**30:>18.2f} {kept / 2**30:>11.2f} {today / kept:>8.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--anchors", type=int, default=16,
                        help="blocks per row (the tests' workers train 16 on these rows)")
    args = parser.parse_args()
    from embedded.tinycache import CACHE_DIR, TARGETS, build_models
    from workers.train.drafter.target_loader import load_target

    torch.set_num_threads(1)
    build_models()
    lengths = [int(n) for n in args.lengths.split(",")]
    for name in TARGETS:
        from embedded.tinymodel import ensure_tiny_model

        target, _ = load_target(ensure_tiny_model(CACHE_DIR, name))
        target.requires_grad_(False)
        rows = measure_terms(target, lengths, args.anchors)
        print("\n".join(render(name, rows)))
    print("\n".join(at_the_users_shape([4096, 8192, 16384, 32768])))


if __name__ == "__main__":
    main()
