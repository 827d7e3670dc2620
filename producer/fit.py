"""Input-side gate: reject at enqueue the conversations that cannot fit the model's context.

A conversation fits when its input messages, rendered with the chat template, plus
``min_answer_tokens`` for every assistant turn to generate stay within the model's context
(``max_position_embeddings`` in its ``config.json``, under ``text_config`` for a multimodal
checkpoint such as Qwen3.5/3.6; read by :class:`common.engine.target.TargetShape`). Earlier answers
are not known yet, so this is a lower bound: a row rejected here would surely be truncated.
Most rows are accepted by a byte count alone (a token covers at least one byte of text; the
template adds a bounded overhead per message), so only long rows are tokenized, and never whole:
a row with more characters than the context could hold (the longest token of the vocabulary
times the tokens left) is rejected by its length alone, and otherwise only a prefix of the
rendered prompt, about ``PREFIX_CHARS_PER_TOKEN`` characters per token left, is tokenized
first; the rest only when that prefix fits (text with unusually long tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from common.engine.models import render_chat
from common.engine.sampling import Sampling
from common.engine.target import TargetShape
from common.inputs.tools import uses_tools

log = logging.getLogger(__name__)

TEMPLATE_OVERHEAD = 16  # tokens of role markup per message, more than any common template adds
PREFIX_CHARS_PER_TOKEN = 8  # twice what prose averages, so the prefix is nearly always decisive
PREFIX_SLACK = 8  # tokens a prefix cut inside a word may add over the same text tokenized whole


def context_length(model_dir: Path) -> int | None:
    """The model's context window (``text_config`` when nested), or None when it does not say."""
    if not (model_dir / "config.json").is_file():
        return None
    return TargetShape.from_dir(model_dir).context_length


@dataclass
class ContextCheck:
    """Says why a normalized conversation cannot fit, or None when it can."""

    model_dir: Path
    context: int | None   # None: the model does not say; only the tool check applies
    min_answer_tokens: int
    sampling: Sampling = Sampling()   # each row renders in its own thinking mode
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def tokenizer(self) -> Any:
        """Loaded on the first row too long for the byte bound (most inputs never need it)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @classmethod
    def for_model(cls, model_dir: Path, min_answer_tokens: int, sampling: Sampling | bool,
                  template_kwargs: dict[str, Any] | None = None) -> ContextCheck | None:
        context = context_length(model_dir)
        if context is None:
            log.warning("model %s does not state its context length; prompts are not checked "
                        "against it", model_dir)
        if isinstance(sampling, bool):
            sampling = Sampling(thinking=sampling)
        return cls(model_dir, context, min_answer_tokens, sampling, dict(template_kwargs or {}))

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (byte-level vocabularies: bytes)."""
        return max(len(token) for token in self.tokenizer.get_vocab())

    @cached_property
    def renders_tools(self) -> str | None:
        """None when the chat template renders tool definitions, calls and results, else why
        not (probed once, on the first tool row)."""
        return tool_support(self.tokenizer, self.template_kwargs)

    def __call__(self, row: dict[str, Any]) -> str | None:
        if uses_tools(row) and self.renders_tools is not None:
            return self.renders_tools
        if self.context is None:
            return None
        messages = [m for group in row["turns"] for m in group]
        answers = len(row["turns"]) * self.min_answer_tokens
        upper = sum(len(str(m.get("content", "")).encode()) + TEMPLATE_OVERHEAD for m in messages)
        if upper + answers <= self.context:
            return None
        room = max(self.context - answers, 0)
        chars = sum(len(str(m.get("content", "")).strip()) for m in messages)
        if chars > (room + 1) * self.max_token_chars:
            return (f"prompt too long: {chars} characters cannot fit in the {room} tokens that "
                    f"the model's context of {self.context} leaves after {answers} for "
                    f"{len(row['turns'])} answer(s) (a token is at most {self.max_token_chars} "
                    "characters)")
        text = render_chat(self.tokenizer, messages, self.sampling.thinking_for(row["id"]),
                           self.template_kwargs, row.get("tools"))
        limit = (room + 1 + PREFIX_SLACK) * PREFIX_CHARS_PER_TOKEN
        prefix = text[:limit]
        if len(text) > limit:  # cut where a word starts, so only the last word can differ
            prefix = prefix[:max(prefix.rfind(" "), prefix.rfind("\n"), limit // 2)]
        prompt, exact = self._tokens(prefix), len(text) <= limit
        if not exact and prompt <= room + PREFIX_SLACK:
            prompt, exact = self._tokens(text), True
        elif not exact:
            prompt -= PREFIX_SLACK  # still more than the room: surely too long
        if prompt + answers <= self.context:
            return None
        least = "" if exact else "at least "
        return (f"prompt too long: {least}{prompt} tokens + {answers} for {len(row['turns'])} "
                f"answer(s) of at least {self.min_answer_tokens} > the model's context of "
                f"{self.context}")

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


_PROBE_TOOL = {"type": "function", "function": {
    "name": "dflash_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string"}}}}}
_PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "dflash_probe_call", "arguments": {"probe_arg": "dflash_probe_value"}}}]},
    {"role": "tool", "content": "dflash_probe_result"}]


def tool_support(tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> str | None:
    """None when the target's chat template shows a tool definition, a call (with its
    argument) and a result in the prompt it renders, else the reason tool rows are rejected."""
    from jinja2 import TemplateError

    try:
        text = render_chat(tokenizer, _PROBE_MESSAGES, True, template_kwargs, [_PROBE_TOOL])
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        # A template raising on tools (its own raise_exception, or a filter on a wrong type).
        return f"the target's chat template cannot render tools ({exc})"
    missing = [what for what, mark in (("tool definitions", "dflash_probe_tool"),
                                       ("tool calls", "dflash_probe_call"),
                                       ("call arguments", "dflash_probe_value"),
                                       ("tool results", "dflash_probe_result"))
               if mark not in text]
    if missing:
        return f"the target's chat template does not render {', '.join(missing)}"
    return None
