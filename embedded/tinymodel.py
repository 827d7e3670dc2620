"""The embedded ``tiny-qwen3`` model: a Qwen3-architecture LM small enough to build and run on CPU.

It lets the whole pipeline (producer, workers, storage) run end to end without a GPU or a model
hub. The first call trains a byte-level BPE tokenizer and a ~2M-parameter ``Qwen3ForCausalLM``
on a synthetic chat corpus (:mod:`embedded.tinycorpus`) for about a minute, then caches it::

    from embedded.tinymodel import ensure_tiny_model
    path = ensure_tiny_model(settings.cache_dir)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                     enable_thinking=True)

Replies look like ``<think>\\n...\\n</think>\\n\\n...<|im_end|>``: random words, real structure.
``enable_thinking=False`` pre-fills an empty think block and the model answers directly. The
saved generation config samples (temperature 0.7, top_p 0.95) and stops on ``<|im_end|>`` or
``<|endoftext|>``. Builds are bit-identical for a given torch version and thread count; bump
``TINY_MODEL_VERSION`` whenever the build changes so that stale caches are ignored.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_MODEL_VERSION = "v2"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
READY_MARKER = "_READY"

# Qwen3's official template minus the tool-calling branches: reasoning is rendered only for
# assistant turns after the last real user query, and enable_thinking=false pre-fills an empty
# think block.
CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + \
reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def ensure_tiny_model(cache_dir: Path) -> Path:
    """Return the cached tiny model directory under ``cache_dir``, building it once if needed."""
    cache_dir = Path(cache_dir)
    final = cache_dir / f"tiny-qwen3-{TINY_MODEL_VERSION}"
    if (final / READY_MARKER).is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / "tiny-qwen3.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the build while we waited for the lock.
        if (final / READY_MARKER).is_file():
            return final
        if final.exists():
            logger.warning("removing incomplete tiny model at %s", final)
            shutil.rmtree(final)
        started = time.monotonic()
        logger.info("building tiny model in %s", final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
        try:
            from embedded.tinybuild import build

            build(tmp)
            (tmp / READY_MARKER).write_text(f"{TINY_MODEL_VERSION}\n")
            # mkdtemp makes the directory private; workers under other users must read it.
            tmp.chmod(0o755)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("tiny model ready in %s (%.1f s)", final, time.monotonic() - started)
    return final
