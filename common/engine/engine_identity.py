"""What a bench verdict was measured with beyond the hardware and the flags: the target's config
(a digest of its ``config.json``), the SGLang version and the engine's Python, so a verdict taken
before an upgrade or for another model is never followed (issue 66).

    ident = EngineIdentity.of(settings)     # model 3f2a..., sglang 0.5.23, python 3.12.3
    ident.digest                            # 8 hex digits for the verdict's key
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from common.choices import EngineKind
from common.config import Settings
from common.errors import ConfigError

log = logging.getLogger(__name__)

# The engine's Python says its own version and SGLang's (it may be a venv other than ours).
_PROBE = ("import sys, importlib.metadata as m\n"
          "try:\n    v = m.version('sglang')\nexcept Exception:\n    v = 'none'\n"
          "print(v)\nprint(sys.version.split()[0])")
PROBE_TIMEOUT = 60.0


@dataclass(frozen=True)
class EngineIdentity:
    """The target's config digest, SGLang's version and the engine's Python version."""

    model: str
    sglang: str
    python: str

    @classmethod
    def of(cls, settings: Settings, model_dir: Path | None = None) -> EngineIdentity:
        """This worker's (or bench's) identity; ``unknown`` for what cannot be read."""
        generate = settings.generate
        if generate.engine is not EngineKind.SGLANG:
            return cls(model_digest(settings, model_dir), "none",
                       sys.version.split()[0])
        sglang, python = probe(generate.engine_python or sys.executable)
        return cls(model_digest(settings, model_dir), sglang, python)

    @property
    def digest(self) -> str:
        text = "\0".join((self.model, self.sglang, self.python))
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def line(self) -> str:
        return f"model {self.model}, SGLang {self.sglang}, Python {self.python}"


def model_digest(settings: Settings, model_dir: Path | None = None) -> str:
    """The first 12 hex digits of the target's config.json's sha256 (``none`` without one)."""
    if model_dir is None:
        from common.engine.models import resolve_model_path

        try:
            model_dir = resolve_model_path(settings)
        except ConfigError:
            return "unknown"
    config = model_dir / "config.json"
    if not config.is_file():
        return "none"
    return hashlib.sha256(config.read_bytes()).hexdigest()[:12]


@lru_cache(maxsize=8)
def probe(python: str) -> tuple[str, str]:
    """(SGLang's version or ``none``, the Python's version) as ``python`` reports them."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("engine python %s did not say its versions: %s", python, exc)
        return "unknown", "unknown"
    return (out[0], out[1]) if len(out) == 2 else ("unknown", "unknown")
