"""Golden tests: moechat's chat template rendering equals transformers' byte for byte.

The transformers side is a real tokenizer: a tiny WordLevel model from the `tokenizers` library wrapped in
PreTrainedTokenizerFast, given a published chat template and special tokens, saved with save_pretrained and
loaded back. moechat reads the very same folder with ChatTemplate.from_model_dir, so loading is tested too.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
from pathlib import Path

import jinja2.exceptions
import pytest

from moechat.engine.errors import ChatTemplateError, ConfigError
from moechat.engine.text.chat_template import ChatTemplate, sandbox

# ---------------------------------------------------------------------------------------------------------------
# Published templates, reproduced as they appear in the models' tokenizer_config.json / chat_template.jinja.
# Raw strings: "\n" inside a Jinja string literal is Jinja's escape, exactly as in the JSON files.

# Qwen/Qwen3-30B-A3B (and the rest of the Qwen3 family): thinking on/off, reasoning_content, tool calls.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
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
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Qwen/Qwen2.5-*-Instruct (and Qwen2-57B-A14B-Instruct's MoE successors): ChatML with a tools block.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Plain ChatML, as in many fine-tunes' tokenizer_config.json (one line).
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# mistralai/Mixtral-8x7B-Instruct-v0.1, current template (optional system message folded into the first turn).
MIXTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# mistralai/Mixtral-8x7B-Instruct-v0.1, original one-line template (no system role at all).
MIXTRAL_ORIGINAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# meta-llama/Meta-Llama-3-8B-Instruct: bos_token on the first turn, `| trim` on content.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# meta-llama/Llama-3.2-1B-Instruct: system prompt, strftime_now, tools as tojson(indent=4), tool calls.
LLAMA32 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# The Qwen3 template with `{% generation %}` blocks around the assistant turns, as training code ships it for
# assistant-only loss masks (note the tags without `-`: trim_blocks/lstrip_blocks decide the whitespace).
QWEN3_GENERATION = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
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
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}

        {{- '<|im_start|>' + message.role }}
        {% generation %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- content }}
            {%- endif %}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {% endgeneration %}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3.1-style template with `{% generation %}` blocks (assistant-mask training variant), including an
# empty generation block after the generation prompt.
LLAMA31_GENERATION = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'}}
        {%- if message.role == 'assistant' %}
            {% generation %}
            {{- message['content'] | trim }}
            {% endgeneration %}
        {%- else %}
            {{- message['content'] | trim }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {% generation %}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
            {% endgeneration %}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {% generation %}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
            {% endgeneration %}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
    {% generation %}
    {% endgeneration %}
{%- endif %}"""

QWEN_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
MISTRAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

# ---------------------------------------------------------------------------------------------------------------
# Conversations

SIMPLE = [{"role": "user", "content": "Hello"}]
MULTI_TURN = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And times 3?"},
]
NON_ASCII = [
    {"role": "system", "content": "Réponds en français 🇫🇷"},
    {"role": "user", "content": "你好，世界 🌍 — naïve café"},
    {"role": "assistant", "content": "こんにちは 👋 \"quoted\" <b>&</b>"},
    {"role": "user", "content": "Ça va? 🤔\n  indented\ttab  "},
]
ALTERNATING_NO_SYSTEM = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
ENDS_WITH_ASSISTANT = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue"},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "查询城市天气 ☀️ (\"now\" & <today>)",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "城市名, e.g. 北京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER_TOOL, {"type": "function", "function": {"name": "now", "description": "Current time."}}]

QWEN3_THINKING_HISTORY = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "\nSimple addition.\n"},
    {"role": "user", "content": "Why?"},
    {"role": "assistant", "content": "<think>\nCounting.\n</think>\n\nBecause 2 and 2 make 4."},
]
QWEN3_REASONING_ALIAS = [  # "reasoning" (OpenAI-style) is copied into reasoning_content by apply_chat_template
    {"role": "user", "content": "Pick a number."},
    {"role": "assistant", "content": "7", "reasoning": "Lucky number."},
]
QWEN_TOOL_CALLS = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "北京天气怎么样？"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the tool.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京", "unit": "celsius"}}},
            {"type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"晴 ☀️\"}"},
    {"role": "tool", "content": "12:00"},
    {"role": "assistant", "content": "北京现在 21°C，晴 ☀️。"},
]
QWEN25_TOOL_CALLS = [
    {"role": "user", "content": "Weather in Zürich? 🌦"},
    {
        "role": "assistant",
        "content": None,  # OpenAI style; apply_chat_template drops None-valued keys
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": "8°C, Regen 🌧"},
]
LLAMA_TOOL_CALLS = [
    {"role": "system", "content": "  You can call tools.  "},
    {"role": "user", "content": "Weather in 東京?"},
    {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}],
    },
    {"role": "tool", "content": {"temp": 18, "sky": "曇り ☁️"}},
]


@dataclasses.dataclass
class Family:
    source: str
    tokens: dict[str, str]
    conversations: dict[str, list[dict]]
    variants: dict[str, dict] = dataclasses.field(default_factory=lambda: {"plain": {}})


FAMILIES = {
    "qwen3": Family(
        QWEN3,
        QWEN_TOKENS,
        {
            "simple": SIMPLE,
            "multi_turn": MULTI_TURN,
            "non_ascii": NON_ASCII,
            "thinking_history": QWEN3_THINKING_HISTORY,
            "reasoning_alias": QWEN3_REASONING_ALIAS,
            "tool_calls": QWEN_TOOL_CALLS,
        },
        {
            "plain": {},
            "thinking_on": {"enable_thinking": True},
            "thinking_off": {"enable_thinking": False},
            "tools": {"tools": TOOLS},
            "tools_thinking_off": {"tools": TOOLS, "enable_thinking": False},
        },
    ),
    "qwen2.5": Family(
        QWEN25,
        QWEN_TOKENS,
        {"simple": SIMPLE, "multi_turn": MULTI_TURN, "non_ascii": NON_ASCII, "tool_calls": QWEN25_TOOL_CALLS},
        {"plain": {}, "tools": {"tools": TOOLS}},
    ),
    "chatml": Family(CHATML, QWEN_TOKENS, {"multi_turn": MULTI_TURN, "non_ascii": NON_ASCII}),
    "mixtral": Family(
        MIXTRAL,
        MISTRAL_TOKENS,
        {
            "simple": SIMPLE,
            "multi_turn": MULTI_TURN,
            "non_ascii": NON_ASCII,
            "alternating": ALTERNATING_NO_SYSTEM,
            "ends_with_assistant": ENDS_WITH_ASSISTANT,
        },
    ),
    "mixtral-original": Family(
        MIXTRAL_ORIGINAL,
        MISTRAL_TOKENS,
        {"simple": SIMPLE, "alternating": ALTERNATING_NO_SYSTEM, "ends_with_assistant": ENDS_WITH_ASSISTANT},
    ),
    "llama3": Family(
        LLAMA3, LLAMA3_TOKENS, {"simple": SIMPLE, "multi_turn": MULTI_TURN, "non_ascii": NON_ASCII}
    ),
    "llama3.2": Family(
        LLAMA32,
        LLAMA3_TOKENS,
        {"simple": SIMPLE, "multi_turn": MULTI_TURN, "non_ascii": NON_ASCII, "tool_calls": LLAMA_TOOL_CALLS},
        {
            "dated": {"date_string": "02 Feb 2025"},
            "tools": {"date_string": "02 Feb 2025", "tools": TOOLS},
            "tools_in_system": {"date_string": "02 Feb 2025", "tools": TOOLS, "tools_in_user_message": False},
        },
    ),
    "qwen3-generation": Family(
        QWEN3_GENERATION,
        QWEN_TOKENS,
        {"multi_turn": MULTI_TURN, "thinking_history": QWEN3_THINKING_HISTORY, "tool_calls": QWEN_TOOL_CALLS},
        {"plain": {}, "thinking_off": {"enable_thinking": False}, "tools": {"tools": TOOLS}},
    ),
    "llama3.1-generation": Family(
        LLAMA31_GENERATION,
        LLAMA3_TOKENS,
        {"multi_turn": MULTI_TURN, "non_ascii": NON_ASCII, "tool_calls": LLAMA_TOOL_CALLS},
        {"plain": {}, "builtin": {"builtin_tools": ["brave_search", "code_interpreter"]}},
    ),
}

# ---------------------------------------------------------------------------------------------------------------
# The transformers side


def _hf_tokenizer_class():
    return pytest.importorskip("transformers").PreTrainedTokenizerFast


def save_tokenizer(path: Path, chat_template, tokens: dict[str, str], *, save_jinja_files: bool = True,
                   **extra) -> Path:
    """A tiny real tokenizer carrying `chat_template` and `tokens`, written the way models ship."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {word: i for i, word in enumerate(dict.fromkeys(["<unk>", *tokens.values(), "hello", "world"]))}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = _hf_tokenizer_class()(tokenizer_object=backend, chat_template=chat_template, **tokens, **extra)
    tokenizer.save_pretrained(str(path), save_jinja_files=save_jinja_files)
    return path


def load_hf(path: Path):
    return _hf_tokenizer_class().from_pretrained(str(path))


def hf_render(tokenizer, messages, *, add_generation_prompt: bool = True, **kwargs) -> str:
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert isinstance(rendered, str)
    return rendered


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """family name -> (transformers tokenizer, moechat ChatTemplate), both read from the same saved folder."""
    pairs = {}
    for name, family in FAMILIES.items():
        folder = save_tokenizer(tmp_path_factory.mktemp(name.replace(".", "_")), family.source, family.tokens)
        ours = ChatTemplate.from_model_dir(folder)
        assert ours is not None
        pairs[name] = (load_hf(folder), ours)
    return pairs


GOLDEN_CASES = [
    pytest.param(family, conversation, variant, add_gen, id=f"{family}-{conversation}-{variant}-gen{int(add_gen)}")
    for family, spec in FAMILIES.items()
    for conversation in spec.conversations
    for variant in spec.variants
    for add_gen in (True, False)
]


@pytest.mark.parametrize(("family", "conversation", "variant", "add_gen"), GOLDEN_CASES)
def test_render_matches_transformers(loaded, family, conversation, variant, add_gen):
    hf, ours = loaded[family]
    messages = FAMILIES[family].conversations[conversation]
    kwargs = FAMILIES[family].variants[variant]
    expected = hf_render(hf, messages, add_generation_prompt=add_gen, **kwargs)
    assert ours.render(messages, add_generation_prompt=add_gen, **kwargs) == expected
    # Guard against a vacuous pass (both sides rendering nothing): the last message's text must be there.
    last = messages[-1].get("content")
    if isinstance(last, str) and last.strip():
        assert last.strip() in expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_special_tokens_match_transformers(loaded, family):
    hf, ours = loaded[family]
    assert ours.special_tokens == hf.special_tokens_map
    assert ours.source == FAMILIES[family].source


# Literal expectations, written by hand from the model cards, so a bug shared by both sides would still show.
@pytest.mark.parametrize(
    ("family", "messages", "kwargs", "expected"),
    [
        pytest.param(
            "qwen3", SIMPLE, {"enable_thinking": False},
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", id="qwen3-no-think",
        ),
        pytest.param(
            "qwen3", SIMPLE, {"enable_thinking": True},
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", id="qwen3-think",
        ),
        pytest.param(
            "mixtral", MULTI_TURN, {},
            "<s> [INST] You are a terse assistant.\n\nWhat is 2+2? [/INST] 4</s> [INST] And times 3? [/INST]",
            id="mixtral-system",
        ),
        pytest.param(
            "llama3", [{"role": "user", "content": "  Hi  "}], {},
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            id="llama3-bos-trim",
        ),
        pytest.param(
            "llama3.2", [{"role": "system", "content": "Be brief."}, *SIMPLE], {"date_string": "02 Feb 2025"},
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 02 Feb 2025\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello"
            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
            id="llama3.2-system",
        ),
    ],
)
def test_render_literal(loaded, family, messages, kwargs, expected):
    _, ours = loaded[family]
    assert ours.render(messages, **kwargs) == expected


def test_tojson_keeps_non_ascii_and_html(loaded):
    hf, ours = loaded["qwen2.5"]
    rendered = ours.render(SIMPLE, tools=[WEATHER_TOOL])
    # json.dumps(ensure_ascii=False) semantics: CJK/emoji verbatim, no \u escapes, no HTML escaping of <>&.
    assert '"description": "查询城市天气 ☀️ (\\"now\\" & <today>)"' in rendered
    assert "\\u" not in rendered
    assert rendered == hf_render(hf, SIMPLE, tools=[WEATHER_TOOL])


TOJSON_OPTIONS = (
    "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}|{{ tools | tojson(ensure_ascii=True) }}|"
    "{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}|{{ add_generation_prompt | tojson }}|"
    "{{ documents | tojson }}"
)


def test_tojson_options_match_transformers(tmp_path):
    folder = save_tokenizer(tmp_path, TOJSON_OPTIONS, QWEN_TOKENS)
    hf, ours = load_hf(folder), ChatTemplate.from_model_dir(folder)
    expected = hf_render(hf, NON_ASCII, tools=TOOLS)
    assert ours.render(NON_ASCII, tools=TOOLS) == expected
    assert "\\u67e5" in expected and "查询" in expected  # both ensure_ascii modes really are exercised


# ---------------------------------------------------------------------------------------------------------------
# raise_exception, and other template failures


@pytest.mark.parametrize(
    ("family", "messages", "message"),
    [
        pytest.param(
            "mixtral",
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "After the optional system message, conversation roles must alternate",
            id="mixtral-two-users",
        ),
        pytest.param(
            "mixtral",
            [{"role": "assistant", "content": "I speak first"}],
            "After the optional system message, conversation roles must alternate",
            id="mixtral-assistant-first",
        ),
        pytest.param(
            "mixtral",
            [*ALTERNATING_NO_SYSTEM, {"role": "tool", "content": "x"}],
            "Only user and assistant roles are supported, with the exception of an initial optional system",
            id="mixtral-tool-role",
        ),
        pytest.param(
            "mixtral-original",
            MULTI_TURN,
            "Conversation roles must alternate user/assistant/user/assistant/...",
            id="mixtral-original-system",
        ),
        pytest.param(
            "llama3.2",
            [{"role": "system", "content": "only a system prompt"}],
            "Cannot put tools in the first user message when there's no first user message!",
            id="llama3.2-tools-without-user",
        ),
    ],
)
def test_raise_exception_becomes_chat_template_error(loaded, family, messages, message):
    hf, ours = loaded[family]
    kwargs = {"tools": TOOLS, "date_string": "1 Jan 2025"} if family == "llama3.2" else {}
    with pytest.raises(jinja2.exceptions.TemplateError) as hf_error:
        hf_render(hf, messages, **kwargs)
    assert message in str(hf_error.value)
    with pytest.raises(ChatTemplateError) as our_error:
        ours.render(messages, **kwargs)
    text = str(our_error.value)
    assert text.startswith("the model's chat template refused the conversation: ")
    assert str(hf_error.value) in text
    assert "\n" not in text


def test_syntax_error_fails_at_construction_on_both_sides(tmp_path):
    broken = "{% for message in messages %}{{ message.content }}"  # missing endfor
    with pytest.raises(ChatTemplateError, match=r"syntax error at line 1: .*endfor"):
        ChatTemplate.from_string(broken)
    hf = load_hf(save_tokenizer(tmp_path, broken, QWEN_TOKENS))
    with pytest.raises(jinja2.exceptions.TemplateSyntaxError):
        hf_render(hf, SIMPLE)


def test_syntax_error_in_model_file_names_the_file(tmp_path):
    save_tokenizer(tmp_path, "{{ messages[0].content }", QWEN_TOKENS)
    with pytest.raises(ChatTemplateError) as error:
        ChatTemplate.from_model_dir(tmp_path)
    assert str(tmp_path / "chat_template.jinja") in str(error.value)
    assert "syntax error" in str(error.value)


@pytest.mark.parametrize(
    ("source", "messages", "fragment"),
    [
        pytest.param("{{ messages[0].nope.deeper }}", SIMPLE, "not set", id="undefined-attribute"),
        pytest.param("{{ missing_variable + 'x' }}", SIMPLE, "not set", id="undefined-variable"),
        pytest.param("{{ messages[0].content + 1 }}", SIMPLE, "TypeError", id="type-error"),
        pytest.param("{{ tools | tojson }}", SIMPLE, "", id="ok"),
    ],
)
def test_runtime_errors_are_chat_template_errors(tmp_path, source, messages, fragment):
    hf = load_hf(save_tokenizer(tmp_path, source, QWEN_TOKENS))
    ours = ChatTemplate.from_model_dir(tmp_path)
    if not fragment:
        assert ours.render(messages) == hf_render(hf, messages) == "null"
        return
    with pytest.raises(Exception):  # noqa: B017 - transformers lets the raw Jinja/Python error through
        hf_render(hf, messages)
    with pytest.raises(ChatTemplateError, match=fragment) as error:
        ours.render(messages)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------------------------
# Sandbox: escape attempts fail with ChatTemplateError and never run anything

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{{ c.__name__ }}{% endfor %}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ joiner.__init__.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__['sys'].modules['os'].system('touch MARKER') }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('MARKER', 'w') }}",
    "{{ strftime_now.__globals__['os'].system('touch MARKER') }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "{{ messages[0]['content'].__class__.__base__.__subclasses__() }}",
    "{{ '{0.__class__.__base__.__subclasses__}'.format(messages) }}",
    "{{ dict.__call__.__globals__ }}",
    "{% set x = [] %}{{ x.append(1) }}{{ x }}",
    "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
    "{% set d = {} %}{{ d.update({'a': 1}) }}",
    "{{ messages[0].update({'content': 'hijacked'}) }}",
    "{{ messages.pop() }}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{% set ns = namespace(__class__=1) %}{{ ns }}",
]


@pytest.mark.parametrize("escape", ESCAPES)
def test_sandbox_escape_is_refused(tmp_path, escape):
    marker = tmp_path / "pwned"
    source = escape.replace("MARKER", str(marker))
    messages = [{"role": "user", "content": "hi"}]
    original = copy.deepcopy(messages)
    with pytest.raises(ChatTemplateError, match="tried to leave the sandbox") as error:
        ChatTemplate.from_string(source, {"bos_token": "<s>"}).render(messages)
    assert "unsafe" in str(error.value)
    assert not marker.exists()
    assert messages == original  # nothing mutated the caller's data either


@pytest.mark.parametrize("escape", ESCAPES)
def test_transformers_refuses_the_same_escapes(tmp_path, escape):
    # Sanity check that these really are escapes, not just things moechat dislikes.
    hf = load_hf(save_tokenizer(tmp_path, escape.replace("MARKER", str(tmp_path / "x")), QWEN_TOKENS))
    with pytest.raises(jinja2.exceptions.SecurityError):
        hf_render(hf, SIMPLE)


def test_unsafe_attribute_probe_is_loud_where_jinja_is_silent(tmp_path):
    # Deliberate difference: Jinja renders an unsafe attribute as an empty Undefined; moechat refuses.
    probe = "{{ ''.__class__ }}{{ messages[0].content }}"
    hf = load_hf(save_tokenizer(tmp_path, probe, QWEN_TOKENS))
    assert hf_render(hf, SIMPLE) == "Hello"
    with pytest.raises(ChatTemplateError, match="'__class__'"):
        ChatTemplate.from_string(probe).render(SIMPLE)


# ---------------------------------------------------------------------------------------------------------------
# Loading from a model folder: every layout transformers reads


def test_template_in_tokenizer_config_string(tmp_path):
    save_tokenizer(tmp_path, QWEN3, QWEN_TOKENS, save_jinja_files=False)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == QWEN3 and not (tmp_path / "chat_template.jinja").exists()
    hf, ours = load_hf(tmp_path), ChatTemplate.from_model_dir(tmp_path)
    assert ours.source == QWEN3
    for kwargs in ({}, {"enable_thinking": False}):
        assert ours.render(QWEN_TOOL_CALLS, tools=TOOLS, **kwargs) == hf_render(hf, QWEN_TOOL_CALLS, tools=TOOLS, **kwargs)


NAMED = {"default": CHATML, "tool_use": QWEN25}


@pytest.mark.parametrize("save_jinja_files", [False, True], ids=["config-list", "jinja-files"])
def test_named_templates(tmp_path, save_jinja_files):
    save_tokenizer(tmp_path, NAMED, QWEN_TOKENS, save_jinja_files=save_jinja_files)
    if save_jinja_files:
        assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    else:
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        assert config["chat_template"] == [{"name": k, "template": v} for k, v in NAMED.items()]
    hf = load_hf(tmp_path)
    default = ChatTemplate.from_model_dir(tmp_path)
    tool_use = ChatTemplate.from_model_dir(tmp_path, name="tool_use")
    assert (default.source, tool_use.source) == (CHATML, QWEN25)
    assert default.render(MULTI_TURN) == hf_render(hf, MULTI_TURN)
    assert tool_use.render(MULTI_TURN) == hf_render(hf, MULTI_TURN, chat_template="tool_use")
    # transformers picks "tool_use" by itself when tools are passed; moechat callers ask for it by name.
    assert tool_use.render(MULTI_TURN, tools=TOOLS) == hf_render(hf, MULTI_TURN, tools=TOOLS)
    with pytest.raises(ConfigError, match="no chat template named 'rag'; available: default, tool_use"):
        ChatTemplate.from_model_dir(tmp_path, name="rag")


def test_jinja_file_wins_over_config_list(tmp_path):
    save_tokenizer(tmp_path, NAMED, LLAMA3_TOKENS, save_jinja_files=False)
    (tmp_path / "chat_template.jinja").write_text(LLAMA3, encoding="utf-8")
    hf, ours = load_hf(tmp_path), ChatTemplate.from_model_dir(tmp_path)
    assert hf.chat_template == ours.source == LLAMA3
    assert ours.render(NON_ASCII) == hf_render(hf, NON_ASCII)
    # Like transformers, the config's templates are gone once a template file exists.
    with pytest.raises(ConfigError, match="no chat template named 'tool_use'"):
        ChatTemplate.from_model_dir(tmp_path, name="tool_use")


def test_config_list_without_default_needs_a_name(tmp_path):
    save_tokenizer(tmp_path, {"rag": CHATML, "tool_use": QWEN25}, QWEN_TOKENS, save_jinja_files=False)
    with pytest.raises(ConfigError, match=r"no default chat template, only named ones \(rag, tool_use\)"):
        ChatTemplate.from_model_dir(tmp_path)
    assert ChatTemplate.from_model_dir(tmp_path, name="rag").source == CHATML


def test_legacy_chat_template_json(tmp_path):
    # Processors (VLMs) used to ship chat_template.json; the tokenizer itself does not read it. Order of
    # precedence: chat_template.jinja, then chat_template.json, then tokenizer_config.json.
    save_tokenizer(tmp_path, CHATML, MISTRAL_TOKENS, save_jinja_files=False)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": MIXTRAL}), encoding="utf-8")
    ours = ChatTemplate.from_model_dir(tmp_path)
    assert ours.source == MIXTRAL
    assert ours.special_tokens == MISTRAL_TOKENS
    assert ours.render(MULTI_TURN) == hf_render(load_hf(tmp_path), MULTI_TURN, chat_template=MIXTRAL)
    (tmp_path / "chat_template.jinja").write_text(LLAMA3, encoding="utf-8")
    assert ChatTemplate.from_model_dir(tmp_path).source == LLAMA3


def test_added_token_dicts_and_model_specific_tokens(tmp_path):
    save_tokenizer(tmp_path, "{{ bos_token }}|{{ eos_token }}|{{ image_token }}|{{ messages[0].content }}", {})
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(
        bos_token={"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                   "rstrip": False, "single_word": False, "special": True},
        eos_token="</s>",
        image_token="<image>",
        add_bos_token=True,  # a "*_token" key that is not a token
    )
    config_path.write_text(json.dumps(config), encoding="utf-8")
    hf, ours = load_hf(tmp_path), ChatTemplate.from_model_dir(tmp_path)
    assert ours.special_tokens == hf.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>",
                                                            "image_token": "<image>"}
    assert ours.render(SIMPLE) == hf_render(hf, SIMPLE) == "<s>|</s>|<image>|Hello"


def test_legacy_special_tokens_map_json(tmp_path):
    save_tokenizer(tmp_path, "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", {"eos_token": "</s>"})
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}), encoding="utf-8"
    )
    hf, ours = load_hf(tmp_path), ChatTemplate.from_model_dir(tmp_path)
    assert ours.special_tokens == hf.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>"}
    assert ours.render(SIMPLE) == hf_render(hf, SIMPLE) == "<s>Hello</s>"


def test_no_template_returns_none(tmp_path):
    save_tokenizer(tmp_path, None, MISTRAL_TOKENS)
    assert load_hf(tmp_path).chat_template is None
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "empty").mkdir()
    assert ChatTemplate.from_model_dir(tmp_path / "empty") is None  # a folder with no tokenizer files at all


@pytest.mark.parametrize(
    ("filename", "content", "fragment"),
    [
        ("tokenizer_config.json", '{"chat_template": "x",', "tokenizer_config.json is not valid JSON ("),
        ("tokenizer_config.json", "[1, 2]", "must hold a JSON object"),
        ("tokenizer_config.json", '{"chat_template": 42}', "chat_template = 42 is not allowed: must be a string"),
        ("tokenizer_config.json", '{"chat_template": [{"name": "a"}]}', "chat_template[0].template is missing"),
        ("chat_template.json", "{oops}", "chat_template.json is not valid JSON"),
        ("chat_template.json", '{"template": "x"}', 'with a "chat_template" key'),
        ("chat_template.jinja", b"\xff\xfe{{ x }}", "is not valid UTF-8"),
    ],
)
def test_bad_files_raise_config_error(tmp_path, filename, content, fragment):
    path = tmp_path / filename
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        ChatTemplate.from_model_dir(tmp_path)
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_folder_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        ChatTemplate.from_model_dir(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------------------------
# Inputs: what apply_chat_template does to messages and kwargs before rendering


class Colour(enum.Enum):
    RED = "red"


class Opaque:
    pass


@dataclasses.dataclass
class Message:
    role: str
    content: str


DUMP = (
    "{{ messages | tojson }}\n{{ tools | tojson }}\n{% if extra is defined %}{{ extra | tojson }}{% endif %}\n"
    "{{ bos_token }}"
)


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        pytest.param(
            [{"role": "assistant", "content": None, "tool_calls": None, "name": "x"}], {}, id="none-keys-dropped"
        ),
        pytest.param(
            [{"role": "assistant", "content": "a", "thinking": "t1", "reasoning_content": "r1"}], {},
            id="reasoning-alias-order",
        ),
        pytest.param([{"role": "assistant", "content": "a", "reasoning": "r"}], {}, id="reasoning-alias"),
        pytest.param([Message("user", "from a dataclass")], {}, id="dataclass-message"),
        pytest.param(
            [{"role": "user", "content": "x", "meta": (1, 2.5, True)}],
            {"extra": {"when": Colour.RED, "obj": Opaque(), "n": 3}}, id="rich-values",
        ),
        pytest.param(SIMPLE, {"tools": [WEATHER_TOOL], "bos_token": "<override>"}, id="kwarg-overrides-token"),
    ],
)
def test_inputs_are_prepared_like_transformers(tmp_path, messages, kwargs):
    folder = save_tokenizer(tmp_path, DUMP, {"bos_token": "<s>"})
    hf, ours = load_hf(folder), ChatTemplate.from_model_dir(folder)
    expected = hf_render(hf, messages, **kwargs)
    assert ours.render(messages, **kwargs) == expected
    assert expected.startswith("[{")


def test_numpy_scalars_become_python_numbers(tmp_path):
    numpy = pytest.importorskip("numpy")
    folder = save_tokenizer(tmp_path, DUMP, {})
    hf, ours = load_hf(folder), ChatTemplate.from_model_dir(folder)
    kwargs = {"extra": {"i": numpy.int64(3), "f": numpy.float32(0.5), "b": numpy.bool_(False)}}
    expected = hf_render(hf, SIMPLE, **kwargs)
    assert ours.render(SIMPLE, **kwargs) == expected
    assert '{"i": 3, "f": 0.5, "b": false}' in expected


def test_documents_are_passed(tmp_path):
    source = "{% for d in documents %}[{{ loop.index }}] {{ d.title }}: {{ d.text }}\n{% endfor %}{{ messages[-1].content }}"
    folder = save_tokenizer(tmp_path, source, {})
    hf, ours = load_hf(folder), ChatTemplate.from_model_dir(folder)
    documents = [{"title": "北京", "text": "Capital 🏯"}, {"title": "Zürich", "text": "Lake"}]
    expected = hf_render(hf, SIMPLE, documents=documents)
    assert ours.render(SIMPLE, documents=documents) == expected == "[1] 北京: Capital 🏯\n[2] Zürich: Lake\nHello"


def test_strftime_now_matches(tmp_path):
    folder = save_tokenizer(tmp_path, LLAMA32, LLAMA3_TOKENS)
    hf, ours = load_hf(folder), ChatTemplate.from_model_dir(folder)
    before = hf_render(hf, MULTI_TURN)
    got = ours.render(MULTI_TURN)
    after = hf_render(hf, MULTI_TURN)
    assert got in (before, after)  # both read the clock; the date may tick over between calls
    assert "Today Date: 26 Jul 2024" not in got


@pytest.mark.parametrize(
    ("family", "messages"),
    [
        pytest.param("chatml", ENDS_WITH_ASSISTANT, id="chatml"),
        pytest.param("chatml", [*SIMPLE, {"role": "assistant", "content": "The answer is "}], id="chatml-keeps-space"),
        pytest.param("llama3", [*SIMPLE, {"role": "assistant", "content": "Hi there "}], id="llama3-trims"),
        pytest.param("qwen2.5", [*SIMPLE, {"role": "assistant", "content": "Sure, 你好"}], id="qwen2.5"),
    ],
)
def test_continue_final_message(loaded, family, messages):
    hf, ours = loaded[family]
    original = copy.deepcopy(messages)
    expected = hf_render(hf, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours.render(messages, continue_final_message=True) == expected
    assert expected.rstrip().endswith(messages[-1]["content"].rstrip())
    assert messages == original


def test_message_shape_errors():
    template = ChatTemplate.from_string(CHATML)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        template.render([])
    with pytest.raises(ChatTemplateError, match="list of message dicts"):
        template.render({"role": "user", "content": "x"})
    with pytest.raises(ChatTemplateError, match="each message must be a dict"):
        template.render(["hello"])
    with pytest.raises(ChatTemplateError, match="JSON-schema dict"):
        template.render(SIMPLE, tools=[print])
    with pytest.raises(ChatTemplateError, match="no 'content' to continue"):
        template.render([{"role": "assistant"}], continue_final_message=True)


def test_compiled_once_per_template(monkeypatch):
    calls = []
    real = sandbox._ENV.from_string

    def counting(source, *args, **kwargs):
        calls.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(sandbox._ENV, "from_string", counting)
    template = ChatTemplate.from_string(QWEN3, QWEN_TOKENS)
    outputs = {template.render(MULTI_TURN, enable_thinking=flag) for flag in (True, False, True)}
    assert calls == [QWEN3]
    assert len(outputs) == 2


def test_variables_are_what_a_keyword_can_change():
    assert {"messages", "tools", "enable_thinking", "add_generation_prompt"} <= ChatTemplate.from_string(QWEN3).variables
    assert "reasoning_effort" not in ChatTemplate.from_string(QWEN3).variables
    assert ChatTemplate.from_string(LLAMA32).variables >= {"date_string", "tools_in_user_message"}
    # Set before it is read: not a variable the caller controls.
    assert ChatTemplate.from_string("{% set x = 1 %}{{ x }}{{ y | tojson }}").variables == {"y"}
