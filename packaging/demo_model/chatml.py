"""ChatML helpers shared by the corpus builder, tokenizer writer and analysis.

The Jinja template below is the Qwen2.5 ChatML form: every message becomes
``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a default system prompt is
inserted when the conversation does not start with one, and
``add_generation_prompt`` appends ``<|im_start|>assistant\\n``.

``render`` is a pure-Python mirror of the template, used to format the chat
part of the corpus before the tokenizer exists; ``train_tokenizer.py`` checks
that ``tokenizer.apply_chat_template`` produces the identical string.
"""

DEFAULT_SYSTEM = "You are a helpful assistant."

BOS = None
EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def render(messages, add_generation_prompt=False):
    """Pure-Python equivalent of CHAT_TEMPLATE."""
    out = []
    if messages and messages[0]["role"] == "system":
        out.append(f"{IM_START}system\n{messages[0]['content']}{IM_END}\n")
        rest = messages[1:]
    else:
        out.append(f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n")
        rest = messages
    for m in rest:
        out.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)
