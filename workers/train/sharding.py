"""FSDP2 for ``worker train --fsdp``: the drafter's parameters and AdamW state sharded over
the group instead of replicated (drafters too big to hold N times, e.g. ~2B parameters).

:func:`shard` applies ``fully_shard`` to each decoder layer and to the drafter, then rebuilds
the optimizer over the sharded parameters with the state they held;
:func:`full_state` gathers the one-rank state dict (a collective: every rank calls it), so an
FSDP checkpoint is a one-rank checkpoint and any group size, ``export-drafter`` included,
reads it. :func:`gathered_drafter` gathers the weights alone into a plain drafter on rank 0,
for the acceptance-length eval that rank 0 decodes alone.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from workers.train.drafter.train import DrafterTrainer


def shard(trainer: DrafterTrainer) -> None:
    """Shard ``trainer``'s drafter over the default group, keeping its optimizer state."""
    mesh = init_device_mesh(trainer.device.type, (dist.get_world_size(),))
    optimizer = trainer.optimizer.state_dict()
    # On a GPU the gathered layers are bf16 (what autocast would compute in anyway, with no
    # cached copy of every weight) and gradients are reduced in float32.
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if trainer.device.type == "cuda" else MixedPrecisionPolicy())
    for layer in trainer.drafter.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(trainer.drafter, mesh=mesh, mp_policy=policy)
    params = list(trainer.drafter.parameters())
    config = trainer.config
    trainer.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas,
                                          weight_decay=config.weight_decay)
    placed = [cast(DTensor, p) for p in params]   # FSDP2 made every parameter a DTensor
    state = {i: {k: distribute_tensor(v, mesh, placed[int(i)].placements) if k != "step" else v
                 for k, v in moments.items()} for i, moments in optimizer["state"].items()}
    trainer.optimizer.load_state_dict({"state": state, "param_groups": optimizer["param_groups"]})


def full_state(trainer: DrafterTrainer, keep: bool) -> dict[str, Any]:
    """The trainer's state with every shard gathered: what :meth:`DrafterTrainer.state_dict`
    gives on one rank. Every rank must call it, in step; only ``keep`` ranks hold the result
    (on the CPU: one gathered tensor at a time is on the GPU)."""
    def full(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        gathered = value.full_tensor()
        return gathered.cpu() if keep else None

    state = trainer.state_dict()
    optimizer = state["optimizer"]
    return {**state, "drafter": {k: full(v) for k, v in state["drafter"].items()},
            "optimizer": {**optimizer, "state": {
                i: {k: full(v) for k, v in moments.items()}
                for i, moments in optimizer["state"].items()}}}


def gathered_drafter(trainer: DrafterTrainer, keep: bool) -> Any:
    """Every rank, in step: the drafter's shards gathered; ``keep`` ranks get a plain (unsharded)
    drafter with those weights, on the trainer's device, in eval mode (others None)."""
    from workers.train.drafter.model import DFlashDraftModel

    state = {}
    for name, value in trainer.drafter.state_dict().items():
        gathered = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            state[name] = gathered.cpu()
    if not keep:
        return None
    heads = trainer.drafter.target_heads
    copy = DFlashDraftModel(trainer.drafter.config, heads.embed, heads.lm_head)
    copy.load_state_dict(state)
    return copy.to(trainer.device).eval()
