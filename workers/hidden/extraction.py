"""Target hidden states for drafter training: one HF forward per length-sorted batch of rows.

    extractor = HiddenExtractor(ExtractorConfig(model_path, layout="dflash", k=5))
    batches, padding = length_batches(rows, max_tokens=32768, max_rows=64)   # workers.batching
    for batch in batches:
        records = extractor.extract(batch)    # list[HiddenRecord], CPU tensors, one per row
    log.info("padding waste %.1f%%", 100 * padding.waste)

The model is loaded once (bf16 on CUDA, float32 on CPU). Each batch is right-padded with an
attention mask and run once through the target's trunk, capturing only the layout's K layers
(and, for eagle3, the final normed state) and stopping after the deepest
(:mod:`workers.capture`); the states are cut back to each row's real length. Records carry the
compute dtype; :class:`common.hidden.writer.HiddenShardWriter` stores them as bf16. Bad output
(NaN/Inf, wrong shapes, token ids that are not the row's) raises
:class:`common.errors.HiddenStateError` naming the rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.choices import Layout
from common.drafter.layers import layer_ids
from common.engine.target import TargetShape
from common.errors import HiddenStateError
from common.hidden.store import HiddenMeta, HiddenRecord, check_record
from common.runs.trainrows import TrainingRow
from workers.capture import LayerCapture
from workers.devices import resolve_device
from workers.target_heads import input_embedding, moved

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtractorConfig:
    """Which target to load, where, and which layers to keep."""

    model_path: str
    layout: str = Layout.DFLASH.value
    k: int = 5
    device: str = "auto"
    dtype: torch.dtype | None = None   # None: bf16 on CUDA, float32 on CPU
    layer_ids: tuple[int, ...] | None = None   # the run's frozen dflash layers (else: by k)

    def resolved_device(self) -> torch.device:
        """``auto`` picks the first CUDA device when there is one (:mod:`workers.devices`)."""
        return resolve_device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype asked for; none: bf16 on CUDA (what the drafter trains on), float32 on
        CPU."""
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return self.dtype


def check_finite(features: torch.Tensor, attention_mask: torch.Tensor,
                 batch: Sequence[TrainingRow], what: str = "hidden_states") -> None:
    """Raise naming the rows whose real positions hold NaN or Inf (one device sync)."""
    per_token = features.sum(dim=-1, dtype=torch.float32)
    bad = ~torch.isfinite(per_token) & attention_mask.bool()
    rows = bad.any(dim=-1)
    if bool(rows.any()):
        names = [f"{batch[i].sample_id}#{batch[i].turn}" for i in rows.nonzero().flatten().tolist()]
        raise HiddenStateError(f"{what} contain NaN or Inf in {len(names)} rows: {names[:5]}")


class HiddenExtractor:
    """Loads the target once and turns batches of training rows into hidden-state records."""

    def __init__(self, config: ExtractorConfig, model: PreTrainedModel | None = None) -> None:
        """Load ``config.model_path``, or use ``model`` as it is (device and dtype included)."""
        self.config = config
        if model is None:
            from transformers import AutoModelForCausalLM

            self.device = config.resolved_device()
            self.dtype = config.resolved_dtype(self.device)
            model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=self.dtype)
            model = moved(model, self.device)
        else:
            weight = input_embedding(model).weight
            self.device, self.dtype = weight.device, weight.dtype
        self.model = model.eval()
        shape = TargetShape.of(self.model)
        self.num_layers: int = shape.num_layers
        self.hidden_size: int = shape.hidden_size
        self.vocab_size: int = shape.vocab_size
        self.layer_ids = (list(config.layer_ids) if config.layer_ids
                          else layer_ids(config.layout, self.num_layers, config.k))
        self.meta = HiddenMeta(layout=config.layout, layer_ids=tuple(self.layer_ids),
                               hidden_size=self.hidden_size, num_layers=self.num_layers,
                               model=str(config.model_path))
        # The decoder trunk alone (no LM head), stopped after the deepest captured layer.
        trunk: nn.Module = self.model.base_model
        self.capture = LayerCapture(trunk, self.layer_ids, final=self.meta.has_last)
        log.info("hidden extractor: %s on %s (%s), %d layers, hidden %d, %s layers %s",
                 config.model_path, self.device, self.dtype, self.num_layers, self.hidden_size,
                 config.layout, self.layer_ids)

    def _inputs(self, batch: Sequence[TrainingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids`` and ``attention_mask``; rejects unusable rows first."""
        width = max(len(r.input_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, row in enumerate(batch):
            n = len(row.input_ids)
            if n == 0 or len(row.loss_mask) != n:
                raise HiddenStateError(f"row {row.sample_id}#{row.turn}: {n} input ids but "
                                       f"{len(row.loss_mask)} loss-mask entries")
            ids[i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
            mask[i, :n] = 1
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise HiddenStateError(f"token ids out of range [0, {self.vocab_size}): min {low}, "
                                   f"max {high} (rows generated with another model?)")
        return ids, mask

    def extract(self, batch: Sequence[TrainingRow]) -> list[HiddenRecord]:
        """One forward over ``batch``; a record per row, in batch order, on the CPU."""
        if not batch:
            return []
        ids, mask = self._inputs(batch)
        with torch.inference_mode():
            device_mask = mask.to(self.device)
            features, last = self.capture.features_and_last(
                input_ids=ids.to(self.device), attention_mask=device_mask, use_cache=False)
            check_finite(features, device_mask, batch)
            if last is not None:
                check_finite(last, device_mask, batch, "last hidden states")
                last = last.cpu()
            features = features.cpu()
        return [self._record(row, i, ids, features, last) for i, row in enumerate(batch)]

    def _record(self, row: TrainingRow, i: int, ids: torch.Tensor, features: torch.Tensor,
                last: torch.Tensor | None) -> HiddenRecord:
        n = len(row.input_ids)
        input_ids = ids[i, :n].to(torch.int32)
        if not torch.equal(input_ids, torch.tensor(row.input_ids, dtype=torch.int32)):
            raise HiddenStateError(f"row {row.sample_id}#{row.turn}: token ids changed on the "
                                   "way through the batch")
        record = HiddenRecord(
            sample_id=row.sample_id, turn=row.turn, input_ids=input_ids,
            loss_mask=torch.tensor(row.loss_mask, dtype=torch.uint8),
            hidden_states=features[i, :n],
            last_hidden_states=None if last is None else last[i, :n],
        )
        check_record(record, self.meta, finite=False)
        return record
