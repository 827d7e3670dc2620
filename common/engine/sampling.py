"""What every generation request samples with, and the thinking mode: the run's sampling record.

Its defaults are the fallbacks when neither an ``enqueue`` option nor the target's
``generation_config.json`` gives a value (:mod:`common.engine.target_sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.thinking import describe, thinking_for

# The budget thinking models are published with (the Qwen3 family's 32,768): long traces are
# kept, not cut and rejected truncated; each request is capped to the room its prompt leaves.
MAX_NEW_TOKENS_CAP = 32768


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters sent to the engine with every request, and the thinking mode.

    ``thinking`` off renders every conversation with thinking off; on, a stable share
    ``thinking_off_share`` of them, chosen by id (``--thinking mix:R``), renders with it off.
    """

    max_new_tokens: int = 2048
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    thinking: bool = True
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    thinking_off_share: float = 0.0

    def thinking_for(self, sample_id: str) -> bool:
        """Whether conversation ``sample_id`` renders with thinking on
        (:mod:`common.engine.thinking`)."""
        return thinking_for(self.thinking, self.thinking_off_share, sample_id)

    @property
    def thinking_mode(self) -> str:
        """``on``, ``off`` or ``mix:R``, as ``--thinking`` takes it."""
        return describe(self.thinking, self.thinking_off_share)
