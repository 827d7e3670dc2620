"""A worker's own measurement of MTP on against off for one run, at its real load (issue 66):
under ``--mtp auto`` with no bench verdict for the worker, the run's shards are generated in
one configuration for a window, then in the other, and the faster is kept.

    measure = Measurement("r", window=180.0, first=True)   # the engine's configuration first
    measure.add(on=True, tokens=412, now=clock())          # each sample the run generates
    decide_mtp(..., measured=measure.view())                # at each shard's start

A window opens at the first sample the run completes in its configuration (the engine launched
and loaded by then) and closes at the first completed after ``window`` seconds: its rate is the
output tokens completed after the opening over that time, with whatever else the worker serves
beside it (its real load); a window open when the engine is relaunched (it ran the other
configuration for another run meanwhile) opens again. With both rates, a configuration is kept
only where it beats the other by :data:`MARGIN` (the bench's), else the one measured last,
which the engine runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from common.engine.mtp import Measured

MARGIN = 0.05   # how much faster a configuration must be to be chosen (as the bench's winner)


def _name(on: bool) -> str:
    return "on" if on else "off"


@dataclass
class Measurement:
    """The windows of one run on this worker: the configuration measured first, the rates."""

    run: str
    window: float
    first: bool
    margin: float = MARGIN
    rates: dict[bool, float] = field(default_factory=dict)
    opened: float | None = None
    tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def measuring(self) -> bool | None:
        """The configuration whose window runs now; None once both are measured."""
        if len(self.rates) == 2:
            return None
        return self.first if self.first not in self.rates else not self.first

    def add(self, on: bool, tokens: int, now: float, launched: float = float("-inf")) -> bool:
        """Count a sample the run completed in configuration ``on`` on an engine ``launched``
        then (a window opened before that spans the other configuration's time: it opens
        again); True where it closed a window."""
        with self._lock:
            if on != self.measuring:
                return False
            if self.opened is None or self.opened < launched:
                self.opened, self.tokens = now, 0
                return False
            self.tokens += tokens
            if now - self.opened < self.window:
                return False
            self.rates[on] = self.tokens / (now - self.opened)
            self.opened = None
            return True

    def winner(self) -> bool | None:
        """The configuration kept (mtp on) once both are measured, else None."""
        if len(self.rates) < 2:
            return None
        on, off = self.rates[True], self.rates[False]
        if on > off * (1 + self.margin):
            return True
        if off > on * (1 + self.margin):
            return False
        return not self.first

    def view(self) -> Measured:
        """Where the measurement stands, as :func:`common.engine.mtp.decide_mtp` reads it."""
        with self._lock:
            winner, measuring = self.winner(), self.measuring
            if winner is None:
                assert measuring is not None
                return Measured(measuring, None, self._measuring_reason(measuring))
            on, off = self.rates[True], self.rates[False]
            rates = {"on": round(on, 1), "off": round(off, 1)}
            faster = (f"mtp {_name(winner)} is faster by more than {self.margin:.0%}"
                      if max(on, off) > min(on, off) * (1 + self.margin) else
                      f"within {self.margin:.0%}: keeps mtp {_name(winner)}, which runs")
            ratio = f" ({on / off:.2f}x)" if off else ""
            return Measured(winner, rates, f"measured on the run's shards at this worker's "
                                           f"load: mtp on {on:,.1f} vs off {off:,.1f} output "
                                           f"tok/s{ratio}: {faster}")

    def _measuring_reason(self, measuring: bool) -> str:
        step = 1 if measuring == self.first else 2
        then = (f"then mtp {_name(not measuring)}; " if step == 1 else "")
        return (f"no bench verdict for this worker: measuring mtp {_name(measuring)} at this "
                f"worker's load with the run's own shards (window {step} of 2, "
                f"{self.window:.0f} s each; {then}the faster by {self.margin:.0%} is kept)")
