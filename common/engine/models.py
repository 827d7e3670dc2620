"""Resolving the target model: the embedded tiny CPU model or a local Hugging Face directory."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, cast

from common.choices import TinyModel
from common.config import Settings
from common.entry_points import MODEL_BUILDERS, TINY_BUILDER, load_entry
from common.errors import ConfigError

TinyBuilder = Callable[[Path, str], Path]
"""(cache_dir, model name) -> the built model's directory, building it once if needed."""


@cache
def tiny_builder() -> TinyBuilder:
    """The embedded models' builder, as the package registers it (``pyproject.toml``'s
    ``dflash_pipeline.model_builders`` entry points): common/ never names the package that
    builds them."""
    return cast(TinyBuilder, load_entry(MODEL_BUILDERS, TINY_BUILDER))


def resolve_model_path(settings: Settings) -> Path:
    """The model directory: an embedded tiny model (built on first use) or a local path."""
    tiny = TinyModel.named(settings.target.model)
    if tiny is not None:
        return tiny_builder()(settings.target.cache_dir, tiny.value)
    path = Path(settings.target.model).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {settings.target.model!r} is not a local directory; download it first "
            "(the pipeline never fetches weights at run time)"
        )
    return path


def chat_template_of(model_dir: Path) -> str | None:
    """The chat template a tokenizer in ``model_dir`` will apply, or None if it has none."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def template_sha(template: str | None) -> str | None:
    """A short fingerprint frozen in run.json so every worker renders prompts the same way."""
    return hashlib.sha256(template.encode()).hexdigest()[:16] if template else None


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool,
                template_kwargs: Mapping[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text the target sees: its chat template, generation prompt, thinking on/off,
    the row's tools (OpenAI structure) and the run's template options
    (``--chat-template-kwargs``, frozen in run.json)."""
    text: str = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                              add_generation_prompt=True,
                                              enable_thinking=thinking,
                                              **(template_kwargs or {}))
    return text


def stop_token_ids(model_path: Path) -> list[int]:
    """End-of-turn ids from generation_config.json: the server stops where the CPU engine does."""
    config = model_path / "generation_config.json"
    if not config.is_file():
        return []
    eos = json.loads(config.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])
