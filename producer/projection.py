"""How many hours a run's generation has left, per configuration, from a bench's measured rates.

    hours[c] = remaining_output_tokens / (output_tokens_per_s[c] x engines) / 3600
    remaining_output_tokens = remaining_samples x output tokens per sample
    engines = gpus // tp

Output tokens per sample come from the committed samples (every generated turn, rejected
samples too: engine time spent), or before any commit from the bench's own replies (mean tokens
per conversation, every turn run as the worker runs it). Each configuration's rate is its best
row (the concurrency to run the workers at), taken over the bench's steady window. The seed's
run: 902,087 samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.choices import MtpMode
from producer.bench import BenchRow

SEED_SAMPLES = 902_087


@dataclass(frozen=True)
class Projection:
    remaining_samples: int
    tokens_per_sample: float
    source: str   # "committed" or "bench"
    gpus: int
    tp: int
    rates: dict[str, float]        # configuration -> output tok/s of one engine, its best row
    concurrency: dict[str, int]    # configuration -> the concurrency of that row

    @property
    def remaining_output_tokens(self) -> int:
        return round(self.remaining_samples * self.tokens_per_sample)

    @property
    def engines(self) -> int:
        return max(1, self.gpus // self.tp)

    @property
    def hours(self) -> dict[str, float]:
        return {mode: self.remaining_output_tokens / (rate * self.engines) / 3600
                for mode, rate in self.rates.items() if rate > 0}

    @property
    def best(self) -> str | None:
        """The configuration that finishes first: the faster one (also with nothing left)."""
        rates = {mode: rate for mode, rate in self.rates.items() if rate > 0}
        return max(rates, key=lambda mode: rates[mode]) if rates else None

    def to_json(self) -> dict[str, Any]:
        return {"remaining_output_tokens": self.remaining_output_tokens, "gpus": self.gpus,
                "hours": {m: round(h, 6) for m, h in self.hours.items()}, "best": self.best,
                "remaining_samples": self.remaining_samples,
                "output_tokens_per_sample": round(self.tokens_per_sample, 1),
                "tokens_per_sample_from": self.source, "tp": self.tp, "engines": self.engines,
                "output_tokens_per_s": {m: round(r, 1) for m, r in self.rates.items()},
                "concurrency": self.concurrency}


def project(rows: Sequence[BenchRow], remaining_samples: int,
            committed: tuple[int, int], bench_turns: float, gpus: int,
            tp: int = 1) -> Projection:
    """The projection of ``rows`` (labelled by configuration) for a run with
    ``remaining_samples`` left and ``committed`` (samples, output tokens) so far."""
    samples, tokens = committed
    conversations = sum(r.conversations for r in rows)
    if samples:
        per_sample, source = tokens / samples, "committed"
    elif conversations:   # the bench ran whole conversations, every turn, as the worker
        per_sample, source = sum(r.total_tokens for r in rows) / conversations, "bench"
    else:
        replies = sum(r.requests for r in rows)
        per_sample = sum(r.output_tokens for r in rows) / replies * bench_turns if replies else 0
        source = "bench"
    best: dict[str, BenchRow] = {}
    for row in rows:
        mode = (row.mtp or MtpMode.OFF).value   # a plain text key (orjson takes no other)
        if mode not in best or row.tokens_per_s > best[mode].tokens_per_s:
            best[mode] = row
    return Projection(remaining_samples, per_sample, source, gpus, tp,
                      {m: r.tokens_per_s for m, r in best.items()},
                      {m: r.concurrency for m, r in best.items()})


def _duration(hours: float) -> str:
    if hours >= 24:
        return f"{hours:,.1f} h ({hours / 24:,.2f} days)"
    if hours >= 1:
        return f"{hours:,.2f} h"
    return f"{hours * 60:,.1f} min" if hours >= 1 / 60 else f"{hours * 3600:,.1f} s"


def render_projection(p: Projection) -> str:
    """The projection under the bench table: what is left, then hours per configuration."""
    lines = [f"projection: {p.remaining_samples:,} samples left x "
             f"{p.tokens_per_sample:,.0f} output tokens each ({p.source} mean) = "
             f"{p.remaining_output_tokens:,} output tokens on {p.gpus} GPU(s)"
             + (f" ({p.engines} engines of tp {p.tp})" if p.tp > 1 else "")]
    hours = p.hours
    for mode, h in sorted(hours.items(), key=lambda kv: kv[1]):
        lines.append(f"  mtp {mode:<3}: {_duration(h)} at concurrency {p.concurrency[mode]}, "
                     f"{p.rates[mode]:,.1f} output tok/s per engine")
    if p.best is not None and len(hours) > 1:
        worst = max(hours.values())
        lines.append(f"best: mtp {p.best} ({worst / hours[p.best]:.2f}x faster than the slowest)"
                     f"; start the workers with --mtp {p.best}")
    return "\n".join(lines)
