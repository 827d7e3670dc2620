"""``bench --run``'s verdict, stored under the run: which configuration (MTP on or off) is faster
at each concurrency, on what hardware and engine arguments; ``--mtp auto`` follows it.

    decider = Decider.of(settings, gpu=0)         # GPU model, TP, engine arguments
    write_verdict(storage, Verdict.of(run, decider, rows, window))   # runs/R/bench/<decider>/
    verdict = read_verdict(storage, run, decider)  # the newest of that decider, or None
    pick = verdict.at(128)                         # the measured concurrency nearest 128

A verdict holds for the hardware and the engine it was measured on: its key names the GPU
model (``nvidia-smi``'s name; ``cpu`` for the CPU engine), the TP size and a digest of the engine
command and arguments (``DFLASH_ENGINE_CMD``, ``DFLASH_ENGINE_ARGS``), so a worker on other GPUs
or with other flags never takes it. Verdicts are put-once; a later bench adds one, and the one
storage wrote last decides (ties by key), as for gate records.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common import keys
from common.config import Settings
from common.engine.lossless import engine_platform
from common.errors import ForeignObject, NotFound
from common.reads import note, read_json
from common.runs.schemas import BENCH_VERDICT
from common.storage import Storage

log = logging.getLogger(__name__)

MODES = ("off", "on")


def gpu_model(gpu: int | None, platform: str) -> str:
    """The GPU's model as ``nvidia-smi`` names it (``cpu`` for the CPU; ``unknown`` when no tool
    says), for the verdict's key."""
    if platform == "cpu":
        return "cpu"
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return "unknown"
    try:
        out = subprocess.run([tool, "--query-gpu=name", "--format=csv,noheader", "-i",
                              str(gpu or 0)], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")[:48] or "unknown"


@dataclass(frozen=True)
class Decider:
    """What decides a bench's result: the GPU model, the TP size, the engine's command line."""

    gpu: str
    tp: int
    engine: str    # a digest of the engine command and arguments

    @classmethod
    def of(cls, settings: Settings, gpu: int | None, environ: dict[str, str]) -> Decider:
        generate = settings.generate
        platform = engine_platform(generate.engine_args, environ)
        engine = "\0".join((generate.engine, generate.engine_cmd, generate.engine_args,
                            generate.mem_fraction_static))
        return cls(gpu_model(gpu, platform), generate.tp,
                   hashlib.sha256(engine.encode()).hexdigest()[:8])

    @property
    def key(self) -> str:
        return f"{slug(self.gpu)}-tp{self.tp}-{self.engine}"


@dataclass(frozen=True)
class Pick:
    """The verdict at one concurrency: the faster configuration and both rates."""

    concurrency: int
    on: bool
    rates: dict[str, float]   # mode -> output tokens/s
    stamp: str

    def line(self) -> str:
        off, on = self.rates["off"], self.rates["on"]
        return (f"bench {self.stamp} at concurrency {self.concurrency}: mtp on {on:,.1f} vs off "
                f"{off:,.1f} output tok/s ({on / off:.2f}x)" if off else "")


@dataclass(frozen=True)
class Verdict:
    run: str
    decider: Decider
    stamp: str
    rows: list[dict[str, Any]]   # BenchRow.to_json() of each configuration and concurrency

    def rates(self) -> dict[int, dict[str, float]]:
        """concurrency -> mode -> output tokens/s, where both modes were measured."""
        found: dict[int, dict[str, float]] = {}
        for row in self.rows:
            found.setdefault(row["concurrency"], {})[row["mtp"]] = row["output_tokens_per_s"]
        return {c: r for c, r in sorted(found.items()) if set(r) == set(MODES)}

    def winners(self) -> dict[int, str]:
        return {c: "on" if r["on"] > r["off"] else "off" for c, r in self.rates().items()}

    def at(self, in_flight: int) -> Pick | None:
        """The measured concurrency nearest ``in_flight`` (the lower on a tie), or None."""
        rates = self.rates()
        if not rates:
            return None
        nearest = min(rates, key=lambda c: (abs(c - in_flight), c))
        return Pick(nearest, rates[nearest]["on"] > rates[nearest]["off"], rates[nearest],
                    self.stamp)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "gpu": self.decider.gpu, "tp": self.decider.tp,
                "engine": self.decider.engine, "stamp": self.stamp, "rows": self.rows,
                "winners": {str(c): w for c, w in self.winners().items()}}


def new_stamp() -> str:
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}"


def write_verdict(storage: Storage, run: str, decider: Decider,
                  rows: Sequence[dict[str, Any]]) -> tuple[str, Verdict] | None:
    """Store the bench's rows as a verdict (put-once); its key and the verdict, or None when no
    concurrency had both configurations measured (nothing to decide)."""
    verdict = Verdict(run, decider, new_stamp(), [dict(r) for r in rows if r.get("mtp")])
    if not verdict.rates():
        return None
    key = keys.bench_verdict(run, decider.key, verdict.stamp)
    import orjson

    if not storage.put_once(key, orjson.dumps(verdict.to_json(), option=orjson.OPT_INDENT_2)):
        raise FileExistsError(f"{key} exists already")
    return key, verdict


def read_verdict(storage: Storage, run: str, decider: Decider) -> Verdict | None:
    """The verdict storage wrote last for ``decider`` (a foreign one noted and passed over for
    the one before it), or None."""
    found = sorted(((o.modified, o.key) for o in
                    storage.list_objects(keys.bench_prefix(run, decider.key))
                    if (k := keys.parse(o.key)) is not None and k.kind is keys.KeyKind.BENCH),
                   reverse=True)
    for _, key in found:
        try:
            record = read_json(storage, key, BENCH_VERDICT)
        except ForeignObject as exc:
            note(exc)
            continue
        except NotFound:
            continue
        return Verdict(run, decider, record["stamp"], [dict(r) for r in record["rows"]])
    return None
