"""The ``tiny-mimo`` target: a dense target with its own MTP head, in MiMo's checkpoint shape.

SGLang generates through a checkpoint's own MTP head (``--speculative-algorithm NEXTN``) only
for the families it registers an MTP class for; the one dense family among them is Xiaomi's
MiMo (``MiMoForCausalLM``: Qwen2 layers, the draft ``MiMoMTP`` in SGLang's
``srt/models/mimo_mtp.py``). This target has that shape at tiny-qwen3's size: the config is
Qwen2's (``model_type: qwen2``, so transformers loads the trunk as ``Qwen2ForCausalLM`` with no
remote code) with ``architectures: ["MiMoForCausalLM"]`` and ``num_nextn_predict_layers: 1``,
and the head is one Qwen2 layer under ``model.mtp_layers.0.*`` with MiMo's ``token_layernorm``,
``hidden_layernorm``, ``input_proj`` and ``final_layernorm`` (transformers ignores them).

Cheap by reuse: tiny-qwen3's tokenizer, chat template, generation config, embedding (tied head)
and layer weights start the trunk (a Qwen2 layer is a Qwen3 layer without the q/k norms, plus
qkv biases, zero here), which a short fine-tune adapts; then the MTP head is trained on the
frozen trunk as SGLang runs it: the final-norm hidden state at position t and the embedding of
token t+1 predict token t+2.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

from embedded import tinybuild

logger = logging.getLogger(__name__)

ARCHITECTURE = "MiMoForCausalLM"   # what SGLang maps to its MiMoMTP draft (model_config.py)
MTP_PREFIX = "model.mtp_layers.0."
TRUNK_STEPS = 300                  # adapting tiny-qwen3's weights to layers without q/k norms
MTP_STEPS = 150
_SEED = 4321
_OWN_NAMES = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")


class MtpLayer(torch.nn.Module):
    """MiMo's multi-token-prediction layer, as SGLang's ``MiMoMultiTokenPredictorLayer`` runs
    it: ``input_proj([hidden_norm(h_t); token_norm(embed(x_t+1))])`` through one decoder layer
    and a final norm, read by the target's (shared) LM head."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = Qwen2RMSNorm(hidden, eps=eps)
        self.hidden_layernorm = Qwen2RMSNorm(hidden, eps=eps)
        self.input_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.mtp_block = Qwen2DecoderLayer(config, layer_idx=0)
        self.final_layernorm = Qwen2RMSNorm(hidden, eps=eps)

    def forward(self, trunk: Qwen2ForCausalLM, hidden: torch.Tensor,
                next_ids: torch.Tensor) -> torch.Tensor:
        """Logits for token t+2 at each position t, from the trunk's final hidden states."""
        embeds = trunk.get_input_embeddings()(next_ids)
        embeds[:, 0] = 0.0   # SGLang's MiMo head zeroes the embedding at position 0
        x = self.input_proj(torch.cat((self.hidden_layernorm(hidden),
                                       self.token_layernorm(embeds)), dim=-1))
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        rotary = trunk.model.rotary_emb(x, positions)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None, None]
        x = self.mtp_block(x, attention_mask=causal, position_ids=positions,
                           position_embeddings=rotary)
        return trunk.lm_head(self.final_layernorm(x))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The head's weights under the names MiMo checkpoints (and SGLang's loader) use."""
        return {MTP_PREFIX + name.removeprefix("mtp_block."): tensor.detach().clone()
                for name, tensor in self.state_dict().items()}

    @classmethod
    def from_checkpoint(cls, model_dir: Path, config: Qwen2Config) -> MtpLayer:
        """The head as stored in ``model_dir`` (the inverse of :meth:`checkpoint_tensors`)."""
        head = cls(config)
        state = {}
        for name, tensor in load_file(Path(model_dir) / "model.safetensors").items():
            if name.startswith(MTP_PREFIX):
                name = name.removeprefix(MTP_PREFIX)
                own = name.split(".", 1)[0] in _OWN_NAMES
                state[name if own else f"mtp_block.{name}"] = tensor
        head.load_state_dict(state)
        return head.eval()


def _config(base: Qwen3ForCausalLM) -> Qwen2Config:
    """tiny-qwen3's sizes and token ids as a Qwen2 config stating one MTP layer."""
    src = base.config
    return Qwen2Config(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size, num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads, num_key_value_heads=src.num_key_value_heads,
        max_position_embeddings=src.max_position_embeddings, rms_norm_eps=src.rms_norm_eps,
        rope_parameters=src.rope_parameters, tie_word_embeddings=True,
        bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id,
        pad_token_id=src.pad_token_id, num_nextn_predict_layers=1,
    )


def _trunk(base: Qwen3ForCausalLM) -> Qwen2ForCausalLM:
    """A Qwen2 model holding every tiny-qwen3 weight it has a place for (all but q/k norms)."""
    model = Qwen2ForCausalLM(_config(base))
    weights = {k: v for k, v in base.state_dict().items() if "_norm." not in k}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or not all(k.endswith("_proj.bias") for k in missing):
        raise RuntimeError(f"tiny-qwen3's weights do not fit a Qwen2 model: missing {missing}, "
                           f"unexpected {unexpected}")
    for name, tensor in model.named_parameters():
        if name.endswith("_proj.bias"):
            torch.nn.init.zeros_(tensor)
    return model


def _train_mtp(trunk: Qwen2ForCausalLM, head: MtpLayer,
               batches: list[dict[str, torch.Tensor]]) -> float:
    """AdamW on the head alone; the trunk is frozen, as at serving time."""
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.01)
    head.train()
    loss = torch.tensor(float("nan"))
    for step in range(MTP_STEPS):
        batch = batches[step % len(batches)]
        with torch.no_grad():
            hidden = trunk(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           output_hidden_states=True).hidden_states[-1]
        logits = head(trunk, hidden[:, :-2], batch["input_ids"][:, 1:-1])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"][:, 2:].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == MTP_STEPS - 1:
            logger.info("mtp step %d loss %.3f", step, loss.item())
    head.eval()
    return loss.item()


def build(dest: Path, base_dir: Path) -> None:
    """Build tiny-mimo into ``dest`` from the tiny-qwen3 build at ``base_dir``."""
    with tinybuild.build_threads():
        _build(dest, base_dir)


def _build(dest: Path, base_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    rng = random.Random(_SEED)
    examples = tinybuild.training_examples(tok, max(TRUNK_STEPS, MTP_STEPS) * tinybuild.BATCH,
                                           rng)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        trunk = _trunk(base)
        batches = tinybuild.make_batches(examples, tok.pad_token_id, rng)
        loss = tinybuild.train(trunk, batches, tinybuild.structure_weights(tok), TRUNK_STEPS)
        logger.info("trunk adapted in %d steps, loss %.3f", TRUNK_STEPS, loss)
        trunk.requires_grad_(False)
        head = MtpLayer(trunk.config)
        logger.info("mtp head trained in %d steps, loss %.3f", MTP_STEPS,
                    _train_mtp(trunk, head, batches))
    trunk.generation_config = base.generation_config
    trunk.save_pretrained(dest, safe_serialization=True)
    weights = dest / "model.safetensors"
    tensors = load_file(weights)
    tensors.update(head.checkpoint_tensors())
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]   # save_pretrained writes the class it saved
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save_pretrained(dest, save_jinja_files=False)   # the template stays in its config
