"""Building an embedded tiny model: tokenizer training, model init, a short training run.

Imported only when :func:`embedded.tinymodel.ensure_tiny_model` finds no cached build, so that
processes that merely locate the model never import torch for it. The dense and hybrid targets
share the tokenizer, corpus and training recipe; the hybrid's architecture is
:mod:`embedded.tinyhybrid`; tiny-mimo is built from tiny-qwen3 by :mod:`embedded.tinymimo`
with the same pieces.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from embedded import tinycorpus, tinyhybrid
from embedded.tinyconsts import (
    CHAT_TEMPLATES,
    END_THINK,
    ENDOFTEXT,
    IM_END,
    IM_START,
    THINK,
    TINY_QWEN3,
    TINY_QWEN3_5,
    TOOL_TOKENS,
)

logger = logging.getLogger(__name__)

_SEED = 1234
_VOCAB_SIZE = 6000
_TRAIN_STEPS = 600
# The hybrid runs torch's Gated DeltaNet fallback (no fla kernels on CPU), several times slower
# per step. With Qwen3.6's template (the prompt opens the think block) 400 steps left it ending
# replies inside the block; 600 close it (8 of 8 MT-Bench prompts, seed 0).
_HYBRID_TRAIN_STEPS = 600
# One thread for both builds: the ops are small, and on 2 shared cores a second thread's
# spin-waits made a dense step 5-10x slower (20 steps: 54 s with 2 threads, 6-12 s with 1, at a
# load average of 6); one thread count also makes every build bit-identical.
_BUILD_THREADS = 1
BATCH = 4
_MAX_LEN = 320
_LR = 3e-3
_STRUCT_WEIGHT = 4.0

# Qwen2/Qwen3 pre-tokenizer split: digits one by one, newline runs kept together.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _build_tokenizer(texts: list[str], name: str) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it with the Qwen3 special tokens and the
    chat template of ``name``'s family."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    # Like Qwen3, the think tags are single tokens but not "special", so decoding with
    # skip_special_tokens=True keeps them and the reasoning stays parseable.
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    if name == TINY_QWEN3_5:  # Qwen3.6's tokenizer holds the tool markers as single tokens too
        bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATES[name]
    return tok


def _build_model(tok: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    """A freshly initialised 8-layer Qwen3 sized for CPU."""
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
    )
    return Qwen3ForCausalLM(config)


def _encode(
    tok: PreTrainedTokenizerFast, messages: list[dict[str, str]], thinking: bool
) -> tuple[list[int], list[int]] | None:
    """Token ids and labels for one conversation; only the final assistant turn is learned."""
    prompt = tok.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    if thinking:
        # The trailing newline after <|im_end|> is never generated, so it is not trained.
        full = tok.apply_chat_template(messages, tokenize=False).removesuffix("\n")
    else:
        full = prompt + messages[-1]["content"] + IM_END
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(full, add_special_tokens=False)["input_ids"]
    if len(ids) > _MAX_LEN or ids[: len(prompt_ids)] != prompt_ids:
        return None
    return ids, [-100] * len(prompt_ids) + ids[len(prompt_ids) :]


def training_examples(tok: PreTrainedTokenizerFast, count: int, rng: random.Random,
                      mt_prompts: list[str] | None = None) -> list[tuple[list[int], list[int]]]:
    """``count`` encoded synthetic conversations (ids, labels) drawn with ``rng``."""
    mt_prompts = tinycorpus.load_mt_bench_prompts() if mt_prompts is None else mt_prompts
    examples = []
    while len(examples) < count:
        # One in ten examples uses enable_thinking=False, so that mode yields answers too.
        thinking = rng.random() >= 0.1
        encoded = _encode(tok, tinycorpus.conversation(rng, mt_prompts), thinking)
        if encoded is not None:
            examples.append(encoded)
    return examples


def make_batches(
    examples: list[tuple[list[int], list[int]]], pad_id: int, rng: random.Random
) -> list[dict[str, torch.Tensor]]:
    """Length-bucketed, right-padded batches in shuffled order (little compute spent on pads)."""
    examples = sorted(examples, key=lambda e: len(e[0]))
    out = []
    for i in range(0, len(examples) - BATCH + 1, BATCH):
        chunk = examples[i : i + BATCH]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        labels = torch.full((len(chunk), width), -100)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (x, y) in enumerate(chunk):
            ids[row, : len(x)] = torch.tensor(x)
            labels[row, : len(y)] = torch.tensor(y)
            mask[row, : len(x)] = 1
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    rng.shuffle(out)
    return out


def structure_weights(tok: PreTrainedTokenizerFast) -> torch.Tensor:
    """Per-vocabulary loss weight: markup and punctuation count ``_STRUCT_WEIGHT`` times a word."""
    markup = set(tok.all_special_ids) | set(tok.convert_tokens_to_ids([THINK, END_THINK]))
    weights = torch.ones(len(tok))
    for i in range(len(tok)):
        if i in markup or not any(c.isalnum() for c in tok.decode([i])):
            weights[i] = _STRUCT_WEIGHT
    return weights


def train(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], vocab_weights: torch.Tensor,
    steps: int = _TRAIN_STEPS,
) -> float:
    """AdamW with linear warm-up and cosine decay over ``steps``; returns the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=_LR, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = 10

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    loss = float("nan")
    for step in range(steps):
        batch = batches[step % len(batches)]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        ce = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
        )
        # Random filler words would drown the few tokens that carry the think/answer/eos
        # structure, which is all the pipeline needs the model to get right.
        weights = vocab_weights[labels.clamp(min=0)].flatten() * (labels.flatten() != -100)
        weighted = (ce * weights).sum() / weights.sum()
        weighted.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = weighted.item()
        if step % 100 == 0 or step == steps - 1:
            logger.info("step %d loss %.3f", step, loss)
    model.eval()
    return loss


def _spare_rows(model: Qwen3ForCausalLM, tokenizer_size: int) -> None:
    """Pad the trained embedding (tied to the head) with zero rows, as Qwen3 checkpoints carry
    spare rows: a drafter's mask token takes one without resizing the served target. Added
    after training, so the trained weights and greedy outputs are those of the unpadded model."""
    rows = tinyhybrid.padded_vocab(tokenizer_size)
    model.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer_size:] = 0.0


@contextmanager
def build_threads() -> Iterator[None]:
    """Torch on ``_BUILD_THREADS`` threads for a build, restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(_BUILD_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build(dest: Path, name: str = TINY_QWEN3) -> None:
    """Train tokenizer and model ``name`` and save them, loadable by ``from_pretrained``."""
    if name == TINY_QWEN3_5:
        make, steps, hybrid = tinyhybrid.build_lm, _HYBRID_TRAIN_STEPS, True
    elif name == TINY_QWEN3:
        make, steps, hybrid = _build_model, _TRAIN_STEPS, False
    else:
        raise ValueError(f"unknown tiny model {name!r}")
    with build_threads():
        _build(dest, name, make, steps, hybrid=hybrid)


def _build(dest: Path, name: str,
           make_model: Callable[[PreTrainedTokenizerFast], torch.nn.Module],
           steps: int, hybrid: bool) -> None:
    rng = random.Random(_SEED)
    mt_prompts = tinycorpus.load_mt_bench_prompts()
    tok = _build_tokenizer(tinycorpus.tokenizer_texts(rng, mt_prompts, 4000), name)
    logger.info("tokenizer trained: %d tokens", len(tok))

    examples = training_examples(tok, steps * BATCH, rng, mt_prompts)

    # fork_rng keeps the caller's global torch RNG untouched by our fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = make_model(tok)
        batches = make_batches(examples, tok.pad_token_id, rng)
        loss = train(model, batches, structure_weights(tok), steps)
        logger.info("trained %d steps, final loss %.3f", steps, loss)

        im_end, endoftext = tok.convert_tokens_to_ids([IM_END, ENDOFTEXT])
        generation = GenerationConfig(
            bos_token_id=endoftext,
            eos_token_id=[im_end, endoftext],
            pad_token_id=endoftext,
            do_sample=True,
            temperature=0.7,
            top_p=0.95,
        )
        if hybrid:
            # Still under the fixed seed: the untrained vision tower and MTP head are
            # initialised reproducibly.
            tinyhybrid.save(model, generation, dest)
        else:
            _spare_rows(model, len(tok))
            model.generation_config = generation
            model.save_pretrained(dest, safe_serialization=True)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tok.save_pretrained(dest, save_jinja_files=False)
