"""What one rank of a 2-rank gloo group holds, for tests/test_plan_terms.py's plan checks:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.fsdp_probe \
        CACHE_DIR OUT_DIR

Every rank builds the same 3-layer drafter on the tiny target (float32 on the CPU: the plan's
``Device(cuda=False)`` branch) and trains it through the production code, twice:

- replicas (:class:`workers.train.parallel.DataParallelTrainer`, DDP's layout): the bytes every
  tensor made since the drafter's build holds right after the optimizer's step (weights,
  gradients, AdamW's moments, anything a reducer would add), counted op by op (:class:`LiveBytes`);
- FSDP2 (:func:`workers.train.sharding.shard`): the shards the rank holds after a step (its
  parameters', gradients' and moments' local tensors), the peak of the gathered parameters
  in a forward, and the peak of a backward that accumulates into existing sharded gradients
  (the gathered layers it gathers again and the reduce-scatter's buffers).

Rank 0 writes the figures and the drafter's config to ``OUT_DIR/terms.json``.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
from torch.distributed.tensor import DTensor

from common.runs.trainrows import TrainingRow
from embedded.memtrack import LiveBytes
from tests.dp_probe import tiny
from workers.train import process_group
from workers.train.drafter.features import target_features
from workers.train.drafter.model import DFlashDraftModel
from workers.train.drafter.train import DrafterTrainer, TrainConfig
from workers.train.parallel import DataParallelTrainer

LAYERS = 3
FEATURES = tuple(range(8))   # every target layer: a root group (fc) of 2/3 of a layer
CONFIG = TrainConfig(total_steps=10, max_anchors=2, seed=5)
ROW_TOKENS = 48   # short rows: what a step holds beside the weights is small


class ResizeAware(LiveBytes):
    """:class:`LiveBytes` that also sees FSDP2 free and re-allocate the gathered parameters by
    resizing their storages (``alloc_storage``/``free_storage``), which no op does."""

    def __init__(self) -> None:
        super().__init__()
        self._resized: dict[int, int] = {}
        self._patched: list[tuple[Any, str, Any]] = []

    def _resize(self, tensor: torch.Tensor, size: int) -> None:
        storage = tensor.untyped_storage()
        delta = size - storage.nbytes()
        if delta:
            storage.resize_(size)
            key = storage._cdata
            self._resized[key] = self._resized.get(key, 0) + delta
            self.current += delta
            self.peak = max(self.peak, self.current)

    def _sweep(self) -> None:
        dead = [key for key, (ref, *_) in self._live.items() if ref.expired()]
        for key in dead:
            self.current -= self._live.pop(key)[1] + self._resized.pop(key, 0)

    def __enter__(self) -> ResizeAware:
        def alloc(tensor: torch.Tensor) -> None:
            self._resize(tensor, tensor.numel() * tensor.itemsize)

        def free(tensor: torch.Tensor) -> None:
            self._resize(tensor, 0)

        for module, name, value in ((_fsdp_param, "alloc_storage", alloc),
                                    (_fsdp_param, "free_storage", free),
                                    (_fsdp_param_group, "alloc_storage", alloc)):
            self._patched.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for module, name, value in self._patched:
            setattr(module, name, value)


def rows(vocab: int, rank: int, count: int) -> list[TrainingRow]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [TrainingRow(f"r{rank}-{i}", 0,
                        torch.randint(0, vocab, (ROW_TOKENS,), generator=gen).tolist(),
                        [0] * 8 + [1] * (ROW_TOKENS - 8)) for i in range(count)]


def trainer_for(target: torch.nn.Module, mask_id: int) -> DrafterTrainer:
    drafter = DFlashDraftModel.for_target(target, mask_id, num_hidden_layers=LAYERS,
                                          layer_ids=FEATURES, init_seed=0)
    return DrafterTrainer(drafter, CONFIG, functools.partial(
        target_features, target, layer_ids=list(drafter.config.target_layer_ids)))


def local_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages under these tensors (a DTensor's: its local shard's)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage()._cdata] = local.untyped_storage().nbytes()
    return sum(storages.values())


def ddp_state(target: torch.nn.Module, mask_id: int, group: process_group.Group) -> int:
    """Bytes made since the drafter's build, held right after a replica's optimizer step."""
    held: list[int] = []
    with LiveBytes() as live:
        trainer = trainer_for(target, mask_id)
        replica = DataParallelTrainer(trainer, replace(group, sharded=False), "probe")
        trainer.optimizer.register_step_post_hook(lambda *args: held.append(live.settle()))
        drawn, _ = trainer.draw(rows(target.config.vocab_size, group.rank, 2))
        part = [(d.row, d.anchors) for d in drawn]
        replica.train_part([part], [1.0], 0, float(len(drawn) * 16))
    return held[0]


def fsdp_terms(target: torch.nn.Module, mask_id: int,
               group: process_group.Group) -> dict[str, int]:
    """The sharded state after a step, a forward's gathered peak, a backward's peak."""
    trainer = trainer_for(target, mask_id)
    DataParallelTrainer(trainer, replace(group, sharded=True), "probe")
    drafter = trainer.drafter
    drawn, _ = trainer.draw(rows(target.config.vocab_size, group.rank, 3))
    first, second = (trainer.pack([d]) for d in drawn[:2])
    held: list[int] = []
    trainer.optimizer.register_step_post_hook(lambda *args: held.append(local_bytes(
        [t for p in drafter.parameters() for t in (p, p.grad, *(
            v for v in trainer.optimizer.state[p].values() if v.dim()))])))
    loss, _ = trainer.forward_sum(first)
    loss.backward()
    trainer.optimizer_step()
    with torch.no_grad(), ResizeAware() as gathering:
        trainer.forward_sum(second)
    loss, _ = trainer.forward_sum(first)
    loss.backward()                    # the sharded gradients now exist: accumulate into them
    loss, _ = trainer.forward_sum(second)
    with ResizeAware() as backward:
        loss.backward()
    return {"fsdp_shards": held[0], "fsdp_gathered": gathering.peak,
            "fsdp_backward": backward.peak}


def main(cache: str, out: str) -> None:
    group = process_group.init_group()
    target, mask_id = tiny(cache)
    figures: dict[str, Any] = {"ddp_state": ddp_state(target, mask_id, group)}
    figures |= fsdp_terms(target, mask_id, group)
    figures["drafter_config"] = asdict(trainer_for(target, mask_id).drafter.config)
    if group.rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "terms.json").write_text(json.dumps(figures))
    group.close()
    process_group.exit_rank(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
