"""Constants shared by the embedded tiny models' cache (tinymodel) and builder (tinybuild).

Both tiny targets use the same tokenizer recipe, special tokens and chat template; only the
architecture differs:

    tiny-qwen3     a dense ``Qwen3ForCausalLM``
    tiny-qwen3.5   a hybrid ``Qwen3_5ForConditionalGeneration`` in Qwen3.6's on-disk shape
                   (nested ``text_config``, Gated DeltaNet + full attention 3:1, MRoPE, a tiny
                   vision tower, an ``mtp.*`` head, spare vocabulary rows)

Bump a model's version whenever its build changes so that stale caches are ignored.
"""

from __future__ import annotations

from pathlib import Path

TINY_QWEN3 = "tiny-qwen3"
TINY_QWEN3_5 = "tiny-qwen3.5"
TINY_MODEL_VERSIONS = {TINY_QWEN3: "v2", TINY_QWEN3_5: "v1"}
TINY_MODELS = tuple(TINY_MODEL_VERSIONS)
TINY_MODEL_VERSION = TINY_MODEL_VERSIONS[TINY_QWEN3]
READY_MARKER = "_READY"


def tiny_model_dir(cache_dir: str | Path, name: str = TINY_QWEN3) -> Path:
    """Where ``name`` is (or will be) cached under ``cache_dir``: its name and build version."""
    if name not in TINY_MODEL_VERSIONS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODELS)}")
    return Path(cache_dir) / f"{name}-{TINY_MODEL_VERSIONS[name]}"


ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"

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
