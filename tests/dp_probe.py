"""K data-parallel drafter steps on the tiny target, for tests/test_train_parallel.py:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.dp_probe \
        CACHE_DIR OUT_DIR FIRST STEPS [STATE]

Steps ``FIRST .. FIRST+STEPS-1`` train on :func:`batch` (from the trainer in ``STATE`` when
given; FSDP2 instead of DDP with ``DFLASH_TRAIN_PARALLEL=fsdp``); rank 0 writes each step's
loss and pre-clip gradient norm to ``OUT_DIR/steps.json`` and the trainer's state after each
step to ``OUT_DIR/state-N.pt`` (N: the trainer's steps so far).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

from common.choices import RankOrder
from common.errors import RankFailed
from common.runs.trainrows import TrainingRow
from embedded.tinymodel import ensure_tiny_model
from workers.train import parallel, process_group
from workers.train.drafter.features import target_features
from workers.train.drafter.model import DFlashDraftModel, add_mask_token
from workers.train.drafter.target_loader import load_target
from workers.train.drafter.train import DrafterTrainer, TrainConfig

ROWS_PER_STEP = 5
CONFIG = TrainConfig(total_steps=20, max_anchors=6, seed=3)


def tiny(cache: str) -> tuple[torch.nn.Module, int]:
    torch.set_num_threads(1)
    target, tokenizer = load_target(ensure_tiny_model(Path(cache)))
    target.requires_grad_(False)
    return target, add_mask_token(tokenizer, target)


def batch(step: int, vocab: int) -> list[TrainingRow]:
    """Seeded random rows of varied length; one in five too short to train on."""
    gen = torch.Generator().manual_seed(1000 + step)
    rows = []
    for i in range(ROWS_PER_STEP):
        prompt = int(torch.randint(4, 12, (1,), generator=gen))
        answer = 3 if i == 2 else int(torch.randint(24, 72, (1,), generator=gen))
        ids = torch.randint(0, vocab, (prompt + answer,), generator=gen).tolist()
        rows.append(TrainingRow(f"s{step}-{i}", 0, ids, [0] * prompt + [1] * answer))
    return rows


def trainer_for(target: torch.nn.Module, mask_id: int, state: str | None) -> DrafterTrainer:
    if state:
        return DrafterTrainer.from_state_dict(torch.load(state, weights_only=True), target)
    drafter = DFlashDraftModel.for_target(target, mask_id, num_hidden_layers=2, init_seed=0)
    return DrafterTrainer(drafter, CONFIG)


def main(cache: str, out: str, first: int, steps: int, state: str | None = None) -> None:
    group = process_group.init_group()
    target, mask_id = tiny(cache)
    if group.rank != 0:
        assert group.receive()[0] is RankOrder.SESSION   # what rank 0's distribute sends
    trainer = trainer_for(target, mask_id, state)
    trainer.featurize = functools.partial(target_features, target,
                                          layer_ids=list(trainer.drafter.config.target_layer_ids))
    trainer = parallel.distribute(trainer, "probe")
    if group.rank != 0:
        while (message := group.receive())[0] is not RankOrder.STOP:
            if message[0] is RankOrder.TRAIN:
                try:
                    trainer.train_part(*message[2:])
                except RankFailed:   # agreed (an injected out-of-memory): rank 0 retries
                    pass
            else:
                trainer.state_dict()   # FSDP2: rank 0 gathers the shards
        group.close()
        process_group.exit_rank(0)
    Path(out).mkdir(parents=True, exist_ok=True)
    metrics, retries = [], []
    for s in range(first, first + steps):
        metrics.append(trainer.step(batch(s, target.config.vocab_size)))
        retries.append(trainer.oom.retries)
        torch.save(trainer.state_dict(), Path(out) / f"state-{trainer.steps}.pt")
    record = {"losses": [m.loss for m in metrics], "grad_norms": [m.grad_norm for m in metrics],
              "oom_retries": retries, "budget": trainer.oom.current,
              "recompute": trainer.oom.recompute}
    (Path(out) / "steps.json").write_text(json.dumps(record))
    group.stop()
    group.close()
    process_group.exit_rank(0)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], int(args[2]), int(args[3]), *args[4:])
