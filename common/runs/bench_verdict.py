"""``bench --run``'s verdict, stored under the run: which configuration (MTP on or off) is faster
at each concurrency, on what hardware and engine arguments; ``--mtp auto`` follows it.

    decider = Decider.of(settings, gpu=0)         # GPU model, TP, engine arguments
    write_verdict(storage, Verdict.of(run, decider, rows, window))   # runs/R/bench/<decider>/
    verdict = read_verdict(storage, run, decider)  # the newest of that decider, or None
    pick = verdict.at(in_flight)   # the steady concurrency nearest the worker's measured load
    on = pick.follow(current)      # its clear winner, else the configuration running now

A verdict holds for the hardware and the engine it was measured on: its key names the GPU
model (``nvidia-smi``'s name; ``cpu`` for the CPU engine), the TP size, a digest of the engine
command and arguments (``DFLASH_ENGINE_CMD``, ``DFLASH_ENGINE_ARGS``) and one of the target's
config.json, the SGLang version and the engine's Python
(:class:`~common.engine.engine_identity.EngineIdentity`), so a worker on other GPUs, with other
flags, another model or an upgraded engine never takes it (a worker says so, as stale).
Verdicts are put-once; a later bench adds one, and the one
storage wrote last decides (ties by key), as for gate records.

Only steady rows (:func:`producer.bench.steady_row`: a window while every slot was held, cut in
equal parts) decide. A configuration wins at a concurrency only when its rate beats the other's
by the verdict's margin (``DFLASH_MTP_MARGIN``, 5% by default) and its slowest part beats the
other's fastest, over at least :data:`MIN_WINDOWS` parts each; else there is no clear winner and
the configuration running stays.
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
from pathlib import Path
from typing import Any

from common import keys
from common.choices import MtpMode
from common.config import Settings
from common.engine.engine_identity import EngineIdentity
from common.engine.lossless import engine_platform
from common.errors import ForeignObject, NotFound
from common.reads import note, read_json
from common.runs.schemas import BENCH_VERDICT
from common.storage import Storage

log = logging.getLogger(__name__)

MODES = ("off", "on")
DEFAULT_MARGIN = 0.05   # a verdict stored before margins: the default's
MIN_WINDOWS = 2         # parts of a steady window each side needs for a winner
NO_CLEAR = "no clear winner"


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
    identity: EngineIdentity | None = None   # the target's config, SGLang, the engine's Python

    @classmethod
    def of(cls, settings: Settings, gpu: int | None, environ: dict[str, str],
           model_dir: Path | None = None) -> Decider:
        generate = settings.generate
        platform = engine_platform(generate.engine_args, environ)
        engine = "\0".join((generate.engine, generate.engine_cmd, generate.engine_args,
                            generate.mem_fraction_static))
        return cls(gpu_model(gpu, platform), generate.tp,
                   hashlib.sha256(engine.encode()).hexdigest()[:8],
                   EngineIdentity.of(settings, model_dir))

    @property
    def hardware(self) -> str:
        """The key's GPU, TP and engine part (a verdict with it and another identity is stale)."""
        return f"{slug(self.gpu)}-tp{self.tp}-{self.engine}"

    @property
    def key(self) -> str:
        ident = self.identity
        return self.hardware + (f"-{ident.digest}" if ident is not None else "")


@dataclass(frozen=True)
class Pick:
    """The verdict at one concurrency: the faster configuration (by the mean), whether it wins
    clearly, and both rates."""

    concurrency: int
    on: bool                  # MTP on is the faster by the mean (the winner where ``clear``)
    rates: dict[str, float]   # mode -> output tokens/s
    stamp: str
    clear: bool = True        # False: within the margin or the parts overlap: no change
    margin: float = DEFAULT_MARGIN

    def follow(self, current: bool) -> bool:
        """MTP on or off after this pick: the clear winner, else ``current`` (no change)."""
        return self.on if self.clear else current

    def line(self) -> str:
        off, on = self.rates["off"], self.rates["on"]
        said = (f"bench {self.stamp} at concurrency {self.concurrency}: mtp on {on:,.1f} vs off "
                f"{off:,.1f} output tok/s" + (f" ({on / off:.2f}x)" if off else ""))
        return said if self.clear else (f"{said}: {NO_CLEAR} (a {self.margin:.0%} margin over "
                                        f"repeated windows), the running configuration stays")


def winner(on: dict[str, Any], off: dict[str, Any], margin: float) -> MtpMode | None:
    """``on`` or ``off`` where its rate beats the other's by ``margin`` and each of its window
    parts beats each of the other's; None: no clear winner."""
    rate = {MtpMode.ON: on["output_tokens_per_s"], MtpMode.OFF: off["output_tokens_per_s"]}
    parts = {MtpMode.ON: on["window_rates"], MtpMode.OFF: off["window_rates"]}
    for mode, other in ((MtpMode.ON, MtpMode.OFF), (MtpMode.OFF, MtpMode.ON)):
        if rate[mode] > rate[other] * (1 + margin) and min(parts[mode]) > max(parts[other]):
            return mode
    return None


@dataclass(frozen=True)
class Verdict:
    run: str
    decider: Decider
    stamp: str
    rows: list[dict[str, Any]]   # BenchRow.to_json() of each configuration and concurrency
    margin: float = DEFAULT_MARGIN

    def steady(self) -> dict[int, dict[str, dict[str, Any]]]:
        """concurrency -> mode -> row, where both modes had a steady window of repeated parts
        (rows not steady, or stored before parts, decide nothing)."""
        found: dict[int, dict[str, dict[str, Any]]] = {}
        for row in self.rows:
            if row.get("steady") is True and len(row.get("window_rates") or ()) >= MIN_WINDOWS:
                found.setdefault(row["concurrency"], {})[row["mtp"]] = row
        return {c: r for c, r in sorted(found.items()) if set(r) == set(MODES)}

    def rates(self) -> dict[int, dict[str, float]]:
        """concurrency -> mode -> output tokens/s, where both modes were measured steady."""
        return {c: {m: r["output_tokens_per_s"] for m, r in rows.items()}
                for c, rows in self.steady().items()}

    def winners(self) -> dict[int, str]:
        """concurrency -> ``on``, ``off`` or :data:`NO_CLEAR`, where both were steady."""
        return {c: winner(r["on"], r["off"], self.margin) or NO_CLEAR
                for c, r in self.steady().items()}

    def at(self, in_flight: int) -> Pick | None:
        """The steady concurrency nearest ``in_flight`` (the lower on a tie), or None. The caller
        passes what the worker measured in flight where it knows it (its cap may not be
        reached), else its ``--max-in-flight``."""
        steady = self.steady()
        if not steady:
            return None
        nearest = min(steady, key=lambda c: (abs(c - in_flight), c))
        rows = steady[nearest]
        rates = {m: r["output_tokens_per_s"] for m, r in rows.items()}
        won = winner(rows["on"], rows["off"], self.margin)
        return Pick(nearest, won is MtpMode.ON if won else rates["on"] > rates["off"], rates,
                    self.stamp, won is not None, self.margin)

    def to_json(self) -> dict[str, Any]:
        ident = self.decider.identity   # what the key's identity digest covers, for the reader
        return {"run": self.run, "gpu": self.decider.gpu, "tp": self.decider.tp,
                "engine": self.decider.engine, "stamp": self.stamp, "rows": self.rows,
                **({"model": ident.model, "sglang": ident.sglang, "python": ident.python}
                   if ident is not None else {}),
                "margin": self.margin,
                "winners": {str(c): w for c, w in self.winners().items()}}


def new_stamp() -> str:
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}"


def write_verdict(storage: Storage, run: str, decider: Decider, rows: Sequence[dict[str, Any]],
                  margin: float = DEFAULT_MARGIN) -> tuple[str, Verdict] | None:
    """Store the bench's rows as a verdict (put-once); its key and the verdict, or None when no
    concurrency had both configurations measured steady (nothing to decide)."""
    verdict = Verdict(run, decider, new_stamp(), [dict(r) for r in rows if r.get("mtp")],
                      margin)
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
        return Verdict(run, decider, record["stamp"], [dict(r) for r in record["rows"]],
                       record.get("margin", DEFAULT_MARGIN))
    return None
