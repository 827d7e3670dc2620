"""The training guide's memory table, from the plan (common/plan): Qwen3.6-27B's shape, the
recipe's 5-layer drafter and 512 anchors a row, one row of each length, per setup.

    python benchmarks/memory_table.py      # the markdown table of docs/guides/training.md

Each GPU's memory is what the device reports (an H100 80GB: 79.19 GiB; an H200: 140.4 GiB),
the plan's margin (8%) left free; tests/test_plan_training.py checks the page holds this table.
"""

from __future__ import annotations

from pathlib import Path

from common.plan.shapes import DrafterDims, TargetDims
from common.plan.verdict import Hardware, TrainingPlan, gib

SHAPE = Path(__file__).parent / "shapes" / "qwen3.6-27b.json"
H100, H200 = 79.19, 140.4
SETUPS = (("one H100 (79.2 GiB)", Hardware(H100), (4096, 32768)),
          ("DDP over 8 x H100", Hardware(H100, 8), (4096, 32768, 65536)),
          ("FSDP over 8 x H100", Hardware(H100, 8, fsdp=True), (4096, 8192, 16384, 32768, 65536)),
          ("one H200 (140.4 GiB)", Hardware(H200), (4096, 32768, 65536)))
HEADER = ("| setup | row tokens | target | drafter state | features | target forward | "
          "drafter step | collective | runtime | total | fits |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def table() -> str:
    """One line per setup and row length."""
    target = TargetDims.load(str(SHAPE))
    drafter = DrafterDims.of(target.shape)
    lines = [HEADER]
    for name, hardware, lengths in SETUPS:
        for tokens in lengths:
            plan = TrainingPlan(target, drafter, hardware, tokens)
            s = plan.step
            step = f"{gib(s.drafter_activations):.1f}" + (" (ckpt)" if s.checkpointing else "")
            lines.append(
                f"| {name} | {tokens:,} | {gib(s.target):.1f} | {gib(s.drafter_state):.1f} | "
                f"{gib(s.features):.2f} | {gib(s.target_transient):.2f} | {step} | "
                f"{gib(s.collective_buffers):.2f} | {gib(s.runtime):.2f} | "
                f"{gib(s.total):.1f} of {gib(hardware.limit):.1f} | "
                f"{'yes' if plan.fits else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
