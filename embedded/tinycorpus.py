"""Synthetic chat corpus for the embedded tiny model (see :mod:`embedded.tinymodel`).

Conversations are random sentences over a few hundred common English words; the user side also
draws real MT-Bench prompts so that real prompts look familiar to the tokenizer and the model.
Everything is driven by a caller-supplied ``random.Random`` so the corpus is reproducible.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

logger = logging.getLogger(__name__)

MT_BENCH_PATH = Path(__file__).resolve().parent.parent / "data" / "mt_bench_question.jsonl"

# Reasoning and answers draw from disjoint word pools: the model can then tell from the last
# few words whether it is still thinking, which it learns far faster than counting back to
# <think>, and so it reliably closes </think> before <|im_end|>.
THINK_WORDS = """
i me my we us you so maybe perhaps because if then first next also now again still just
should could would might must can will need want try think know guess wonder recall remember
consider check verify compare weigh decide choose plan outline list note mention focus
question asks asked request user prompt goal point idea reason detail step option case
answer reply response draft structure tone style length format example evidence assumption
clear unclear simple tricky obvious likely unlikely possible important relevant useful careful
wait hmm okay right actually probably certainly briefly mainly exactly roughly
start begin explain describe cover include avoid keep make sure find see look say write
""".split()

ANSWER_WORDS = """
the a an this that these those some many few every each other same new old good bad great small
large long short high low early late young big little real strong light dark warm cold quick
slow easy hard happy sad free full busy quiet people person man woman child friend family group
team city country world home house room school office market street road river lake sea sky
sun moon star tree flower garden park forest field water food bread apple coffee tea music song
book story letter paper word name time day week month year morning night hour life work job
money price cost value number line table chart map model system process method rule law power
energy sound color shape size space area level car train bus plane ship bike trip travel
journey museum beach island mountain village culture art history science nature health sport
game movie show picture photo computer phone data code program language teacher student doctor
artist writer leader player worker scientist engineer manager is are was were be has have had
does did makes made takes took gives gave gets sees saw feels finds uses tells shows keeps
starts learns builds writes reads moves changes grows brings visits follows shares helps
and or but with about from into over under between through during without within around
in on at by for of to very often always never sometimes usually quite more most less well
""".split()

WORDS = THINK_WORDS + ANSWER_WORDS

TOPICS = """
travel cooking history physics biology economics music painting poetry chess football gardening
programming databases networks mathematics geometry statistics philosophy ethics medicine
nutrition exercise sleep weather climate oceans volcanoes planets rockets trains cities
languages writing marketing finance careers education parenting pets birds insects forests
""".split()

_ASKS = (
    "Tell me about {t}.",
    "Explain {t} to a beginner.",
    "What is the most important idea in {t}?",
    "Write a short note about {t}.",
    "Give me some advice on {t}.",
    "How do people learn {t}?",
    "Compare {t} and {u}.",
    "Why does {t} matter for {u}?",
)


def load_mt_bench_prompts(path: Path = MT_BENCH_PATH) -> list[str]:
    """Every user turn of the MT-Bench file, or an empty list when the file is absent."""
    if not path.is_file():
        logger.warning("MT-Bench prompts not found at %s; building without them", path)
        return []
    prompts: list[str] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                prompts.extend(json.loads(line)["turns"])
    return prompts


def sentence(rng: random.Random, n: int, pool: list[str] = WORDS) -> str:
    """One capitalised sentence of ``n`` random words from ``pool`` ending with a full stop."""
    words = [rng.choice(pool) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def passage(rng: random.Random, lo: int, hi: int, pool: list[str] = WORDS) -> str:
    """Sentences from ``pool`` totalling between ``lo`` and ``hi`` words."""
    left = rng.randint(lo, hi)
    parts = []
    while left > 0:
        # Leave at least four words behind so the last sentence is never a stub.
        n = left if left < 12 else rng.randint(4, min(10, left - 4))
        parts.append(sentence(rng, n, pool))
        left -= n
    return " ".join(parts)


def segment(rng: random.Random, pool: list[str], least: int = 2, most: int = 4) -> str:
    """``least`` to ``most`` sentences of 5-10 words: a reasoning block or an answer."""
    # After ``least`` sentences the text stops with probability 1/2 at every sentence end. A
    # constant, even hazard survives temperature sampling (0.7 would sharpen a uniform length
    # distribution's small early hazards towards never stopping) and keeps outputs short.
    parts = [sentence(rng, rng.randint(5, 10), pool) for _ in range(least)]
    while len(parts) < most and rng.random() < 0.5:
        parts.append(sentence(rng, rng.randint(5, 10), pool))
    return " ".join(parts)


def user_prompt(rng: random.Random, mt_prompts: list[str]) -> str:
    """A synthetic request, or a real MT-Bench prompt about a third of the time."""
    if mt_prompts and rng.random() < 0.35:
        return rng.choice(mt_prompts)
    ask = rng.choice(_ASKS).format(t=rng.choice(TOPICS), u=rng.choice(TOPICS))
    if rng.random() < 0.5:
        return ask
    return f"{passage(rng, 5, 25)} {ask}"


def conversation(rng: random.Random, mt_prompts: list[str]) -> list[dict[str, str]]:
    """One or two user turns; only the final assistant turn carries ``reasoning_content``."""
    messages: list[dict[str, str]] = []
    if rng.random() < 0.1:
        messages.append({"role": "system", "content": sentence(rng, rng.randint(4, 10))})
    if rng.random() < 0.4:
        messages.append({"role": "user", "content": user_prompt(rng, mt_prompts)})
        messages.append({"role": "assistant", "content": segment(rng, ANSWER_WORDS)})
    messages.append({"role": "user", "content": user_prompt(rng, mt_prompts)})
    messages.append(
        {
            "role": "assistant",
            # Long enough that a reply clears the quality gates' floor of 32 generated tokens.
            "reasoning_content": segment(rng, THINK_WORDS, least=4, most=7),
            "content": segment(rng, ANSWER_WORDS),
        }
    )
    return messages


def tokenizer_texts(rng: random.Random, mt_prompts: list[str], n: int) -> list[str]:
    """Plain text for BPE training: synthetic passages plus every MT-Bench prompt."""
    texts = [passage(rng, 20, 60) for _ in range(n)]
    texts += [user_prompt(rng, []) for _ in range(n // 4)]
    # Chat markup pieces, so role names and the blank line after </think> get their own tokens.
    texts += [f"{passage(rng, 5, 10)}\n\n{passage(rng, 5, 10)}" for _ in range(n // 10)]
    texts += ["system\nuser\nassistant\n"] * (n // 10)
    return texts + mt_prompts
