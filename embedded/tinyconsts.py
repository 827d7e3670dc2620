"""Constants shared by the embedded tiny models' cache (tinymodel) and builder (tinybuild).

The tiny targets use the same tokenizer recipe and special tokens; each speaks its family's
conversation format:

    tiny-qwen3     a dense ``Qwen3ForCausalLM`` with Qwen3's chat template (tools as JSON calls)
                   and spare (zero) vocabulary rows, as Qwen3 checkpoints have
    tiny-qwen3.5   a hybrid ``Qwen3_5ForConditionalGeneration`` in Qwen3.6's on-disk shape
                   (nested ``text_config``, Gated DeltaNet + full attention 3:1, MRoPE, a tiny
                   vision tower, an ``mtp.*`` head, spare vocabulary rows) with a template that
                   behaves as Qwen3.5/3.6's (generation prompt opens the think block, XML tool
                   calls, ``preserve_thinking``) and the tool markers as single tokens
    tiny-mimo      a dense target with its own MTP head in MiMo's shape (``MiMoForCausalLM``:
                   Qwen2 layers, ``model.mtp_layers.0.*``, ``num_nextn_predict_layers: 1``),
                   the one dense family SGLang serves NEXTN for; built from tiny-qwen3 (its
                   tokenizer, template and weights), see :mod:`embedded.tinymimo`

Bump a model's version whenever its build changes so that stale caches are ignored.
"""

from __future__ import annotations

from pathlib import Path

TINY_QWEN3 = "tiny-qwen3"
TINY_QWEN3_5 = "tiny-qwen3.5"
TINY_MIMO = "tiny-mimo"
TINY_MODEL_VERSIONS = {TINY_QWEN3: "v4", TINY_QWEN3_5: "v2", TINY_MIMO: "v1"}
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

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Both templates share the history rules: reasoning is read from ``reasoning_content`` when it
# is a string, else split out of ``content`` at </think>; a tool result (role ``tool``) is a
# user block of <tool_response>s, and the last real user query is the last user message that
# is not one.
_LAST_QUERY = """\
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
"""
_SPLIT_REASONING = """\
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
"""
_TOOL_RESULT = """\
    {%- elif message.role == "tool" %}
        {%- if loop.first or (loop.previtem.role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (loop.nextitem.role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
"""
_CONTENT = """\
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
"""

# Qwen3's template: tools as JSON signatures in the system message, calls as JSON in
# <tool_call>; reasoning rendered only after the last real user query; enable_thinking=false
# pre-fills an empty think block, thinking on leaves the reply to open its own.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name \\
and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n\\
{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
""" + _LAST_QUERY + """\
{%- for message in messages %}
""" + _CONTENT + """\
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
""" + _SPLIT_REASONING + """\
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + \
reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
""" + _TOOL_RESULT + """\
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Behaves as Qwen3.5/3.6's published template: the generation prompt opens the think block
# (an empty closed one with thinking off), so a reply starts inside it; an assistant message
# renders its reasoning after the last real user query or with preserve_thinking; tools make
# a system block (XML call instructions, the system prompt after them) and calls render as
# <function=NAME> with one <parameter=ARG> per argument.
QWEN3_6_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n\\
<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format \\
with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n\\
<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
    {%- if messages[0].role == 'system' and messages[0].content is string \
and messages[0].content | trim %}
        {{- '\\n\\n' + messages[0].content | trim }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content | trim + '<|im_end|>\\n' }}
{%- endif %}
""" + _LAST_QUERY + """\
{%- for message in messages %}
""" + _CONTENT + """\
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
""" + _SPLIT_REASONING + """\
        {%- set reasoning_content = reasoning_content | trim %}
        {%- if (preserve_thinking is defined and preserve_thinking is true) \
or loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content + \
'\\n</think>\\n\\n' + content | trim }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content | trim }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if not loop.first or content | trim %}
                    {{- '\\n\\n' if loop.first else '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
                {%- if tool_call.arguments is mapping %}
                    {%- for name, value in tool_call.arguments | items %}
                        {{- '<parameter=' + name + '>\\n' }}
                        {%- if value is mapping or (value is sequence and value is not string) %}
                            {{- value | tojson }}
                        {%- else %}
                            {{- value | string }}
                        {%- endif %}
                        {{- '\\n</parameter>\\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
""" + _TOOL_RESULT + """\
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""
CHAT_TEMPLATES = {TINY_QWEN3: CHAT_TEMPLATE, TINY_QWEN3_5: QWEN3_6_CHAT_TEMPLATE}
