"""Demo training rows: the tiny CPU target answering MT-Bench prompts, for tests and benchmarks.

    target, tokenizer = load_target(ensure_tiny_model(cache_dir))  # drafter.target_loader
    rows = demo_rows(target, tokenizer, prompts=mt_bench_prompts(path, 32), seed=0)

Prompts get the chat template with thinking on; replies are sampled with the model's generation
config (seeded), cut after the first end-of-turn token, and become ``TrainingRow``s with the
loss mask on the reply, exactly as :mod:`common.runs.trainrows` builds them from generated samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from common.runs.trainrows import TrainingRow


def mt_bench_prompts(path: str | Path, limit: int) -> list[str]:
    """The first turn of the first ``limit`` MT-Bench questions."""
    prompts = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                prompts.append(json.loads(line)["turns"][0])
            if len(prompts) >= limit:
                break
    return prompts


@torch.no_grad()
def demo_rows(target: Any, tokenizer: Any, prompts: list[str], seed: int = 0,
              max_new_tokens: int = 256, batch_size: int = 16) -> list[TrainingRow]:
    """One sampled single-turn reply per prompt, as training rows (reply tokens supervised)."""
    eos = target.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    stops.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(seed)
    rows = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        prompt_ids = [tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
            enable_thinking=True, return_dict=False) for p in chunk]
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):           # left padding for generation
            ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        out = target.generate(input_ids=ids, attention_mask=attention,
                              max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=pad)
        for i, p in enumerate(prompt_ids):
            reply = out[i, width:].tolist()
            end = next((j for j, t in enumerate(reply) if t in stops), len(reply) - 1)
            reply = reply[: end + 1]
            rows.append(TrainingRow(f"demo-{start + i}", 0, list(p) + reply,
                                    [0] * len(p) + [1] * len(reply)))
    return rows
