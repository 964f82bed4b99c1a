"""Tool calls parsed out of generated text (engine/text/tool_calls.py), fed in every split the stream can make."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moechat.engine.text.tool_calls import (
    GEMMA,
    HARMONY,
    HERMES,
    GemmaToolParser,
    HarmonyToolParser,
    HermesToolParser,
    ToolCall,
    make_tool_parser,
    gemma_arguments,
    tool_call_format,
)

QWEN3_TEMPLATE_BITS = ("{%- if tools %}<tools>{{ tool | tojson }}</tools> ... <tool_call>\\n{\"name\": ...}"
                       "</tool_call>{%- endif %}<think>\\n\\n</think>")
GPT_OSS_TEMPLATE_BITS = "<|start|>assistant<|channel|>final<|message|>{{ content }}<|end|> to=functions."


def _feed(parser, text: str, step: int):
    thinking, answer, calls = [], [], []
    for i in range(0, len(text), step):
        d = parser.feed(text[i : i + step])
        thinking.append(d.thinking)
        answer.append(d.answer)
        calls += parser.take_calls()
    d = parser.flush()
    thinking.append(d.thinking)
    answer.append(d.answer)
    calls += parser.take_calls()
    return "".join(thinking), "".join(answer), calls


GEMMA4_TEMPLATE_BITS = ("{{ '<|tool_call>call:' + function['name'] + '{' }}{{ '}<tool_call|>' }}"
                        "{{ '<|channel>thought\\n<channel|>' }}")


def test_formats_follow_the_template():
    assert tool_call_format(GEMMA4_TEMPLATE_BITS) == GEMMA
    assert tool_call_format(QWEN3_TEMPLATE_BITS) == HERMES
    assert tool_call_format(GPT_OSS_TEMPLATE_BITS) == HARMONY
    assert tool_call_format("{{ messages }}") is None
    assert make_tool_parser("{{ messages }}") is None


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_qwen3_thinking_answer_and_two_calls(step):
    text = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
            '"arguments": {}}\n</tool_call>')
    parser = make_tool_parser(QWEN3_TEMPLATE_BITS, "<|im_start|>assistant\n")
    thinking, answer, calls = _feed(parser, text, step)
    assert thinking == "The user wants weather."
    assert answer.strip() == "Let me check."
    assert calls == [ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "c"})), ToolCall("get_time", "{}")]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_hermes_keeps_a_block_that_is_not_a_call(step):
    text = "Use <tool_call>not json</tool_call> like so, and <tool_c"
    thinking, answer, calls = _feed(HermesToolParser(), text, step)
    assert (thinking, calls) == ("", [])
    assert answer == text  # nothing the model said is lost, a trailing partial marker included


def test_hermes_unterminated_call_at_the_end_is_parsed():
    _, answer, calls = _feed(HermesToolParser(), '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n', 5)
    assert answer == "" and calls == [ToolCall("f", '{"x": 1}')]


@pytest.mark.parametrize("step", [1, 3, 11, 1000])
def test_gpt_oss_analysis_then_a_function_call(step):
    # generation starts after the prompt's "<|start|>assistant"; <|call|> is a stop token (never in the text)
    text = ('<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant to=functions.get_weather'
            '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}')
    parser = make_tool_parser(GPT_OSS_TEMPLATE_BITS, "<|end|><|start|>assistant")
    assert isinstance(parser, HarmonyToolParser)
    thinking, answer, calls = _feed(parser, text, step)
    assert thinking == "Need the weather tool."
    assert answer == ""
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}')]


def test_gpt_oss_recipient_after_the_channel_and_a_final_answer_without_calls():
    text = ('<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"q": 1}<|end|>'
            '<|start|>assistant<|channel|>final<|message|>Done.')
    thinking, answer, calls = _feed(HarmonyToolParser("<|start|>assistant"), text, 2)
    assert calls == [ToolCall("lookup", '{"q": 1}')]
    assert (thinking, answer) == ("", "Done.")
    _, answer, calls = _feed(HarmonyToolParser("<|start|>assistant"),
                             "<|channel|>final<|message|>Just text.", 3)
    assert (answer, calls) == ("Just text.", [])


def test_real_qwen3_template_renders_tools_and_its_calls_parse():
    """The Qwen3 template transformers ships (quoted in test_chat_template.py): tools in the prompt, hermes calls."""
    import importlib.util
    import sys
    from pathlib import Path

    from moechat.engine.text.chat_template import ChatTemplate

    spec = importlib.util.spec_from_file_location("_templates", Path(__file__).with_name("test_chat_template.py"))
    templates = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, templates)  # its dataclasses look their module up
    spec.loader.exec_module(templates)
    template = ChatTemplate.from_string(templates.QWEN3, templates.QWEN_TOKENS)
    assert "tools" in template.variables
    prompt = template.render(templates.SIMPLE, add_generation_prompt=True, tools=templates.TOOLS)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    assert tool_call_format(templates.QWEN3) == HERMES
    parser = make_tool_parser(templates.QWEN3, prompt[-40:])
    _, answer, calls = _feed(parser, '<think>\nok\n</think>\n\n<tool_call>\n{"name": "now", "arguments": {}}\n'
                             "</tool_call>", 6)
    assert answer.strip() == "" and calls == [ToolCall("now", "{}")]


SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"


@pytest.mark.skipif(not (SHARED / "openai-gpt-oss-120b.jinja").is_file(), reason="../shared/chat-templates absent")
def test_real_gpt_oss_template_renders_tools_and_reads_back_the_call():
    from moechat.engine.text.chat_template import ChatTemplate

    source = (SHARED / "openai-gpt-oss-120b.jinja").read_text()
    assert tool_call_format(source) == HARMONY
    template = ChatTemplate.from_string(source, {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"})
    assert "tools" in template.variables
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = template.render(messages, add_generation_prompt=True, tools=tools)
    assert "namespace functions" in prompt and "type get_weather" in prompt
    assert prompt.endswith("<|start|>assistant")
    reply = ('<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary '
             'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}')
    parser = make_tool_parser(source, prompt[-40:])
    thinking, answer, calls = _feed(parser, reply, 4)
    assert (thinking, answer, calls) == ("Use the tool.", "", [ToolCall("get_weather", '{"city":"Paris"}')])
    # the call goes back in the next turn with its arguments as a dict, which this template serialises itself
    # (moechat serve turns OpenAI's JSON-string arguments into one, as vLLM does)
    history = messages + [
        {"role": "assistant", "content": "", "thinking": thinking, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": json.loads(calls[0].arguments)}}]},
        {"role": "tool", "content": "18 C"}]
    again = template.render(history, add_generation_prompt=True, tools=tools)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|>') in again
    assert again.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C"<|end|>'
                          "<|start|>assistant")


@pytest.mark.skipif(not (SHARED / "Qwen-Qwen3-0.6B.jinja").is_file(), reason="../shared/chat-templates absent")
def test_real_qwen3_template_from_the_hub_is_hermes():
    source = (SHARED / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert tool_call_format(source) == HERMES
    reply = '<think>\nx\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": [1]}}\n</tool_call>'
    _, answer, calls = _feed(make_tool_parser(source, "<|im_start|>assistant\n"), reply, 3)
    assert answer.strip() == "" and calls == [ToolCall("f", '{"a": [1]}')]


# -- Gemma 4: <|tool_call>call:NAME{...}<tool_call|> in Gemma's argument notation ---------------------------------

Q = '<|"|>'


@pytest.mark.parametrize(("text", "value"), [
    ("{}", {}),
    (f"{{city:{Q}Paris, FR{Q}}}", {"city": "Paris, FR"}),
    (f"{{days:2,temp:-1.5,big:3e2,ok:true,no:false,none:null}}",
     {"days": 2, "temp": -1.5, "big": 300.0, "ok": True, "no": False, "none": None}),
    (f"{{tags:[{Q}a{Q},{Q}b: c{Q}],grid:[[1,2],[]],opts:{{deep:{{x:{Q}{{}}[],{Q}}}}}}}",
     {"tags": ["a", "b: c"], "grid": [[1, 2], []], "opts": {"deep": {"x": "{}[],"}}}),
    (f"{{ {Q}quoted key{Q} : {Q}v{Q} , spaced : 1 }}", {"quoted key": "v", "spaced": 1}),
    (f"{{text:{Q}line one\nline \"two\" 🌍{Q}}}", {"text": 'line one\nline "two" 🌍'}),
])
def test_gemma_argument_notation(text, value):
    assert gemma_arguments(text) == value


@pytest.mark.parametrize("text", ["", "[1]", "{city:Paris}", f"{{city:{Q}Paris}}", "{a:1,}", "{a:1} trailing",
                                  "{:1}", "{a 1}", "{a:[1,2}", "{" * 100 + "}" * 100])
def test_gemma_argument_notation_refuses_what_it_is_not(text):
    with pytest.raises(ValueError):
        gemma_arguments(text)


@pytest.mark.parametrize("step", [1, 2, 5, 13, 1000])
def test_gemma4_thinking_answer_and_two_calls(step):
    text = (f"<|channel>thought\nThe user wants weather.<channel|>Checking.<|tool_call>call:get_weather{{city:{Q}Paris"
            f"{Q},days:2}}<tool_call|><|tool_call>call:now{{}}<tool_call|>")
    parser = make_tool_parser(GEMMA4_TEMPLATE_BITS, "<|turn>model\n")
    assert isinstance(parser, GemmaToolParser)
    thinking, answer, calls = _feed(parser, text, step)
    assert thinking == "The user wants weather."
    assert answer == "Checking."
    assert calls == [ToolCall("get_weather", json.dumps({"city": "Paris", "days": 2})), ToolCall("now", "{}")]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_gemma4_keeps_a_block_that_is_not_a_call(step):
    text = f"See <|tool_call>call:f{{x:{Q}open}}<tool_call|> and <|tool_call>nocall<tool_call|> then <|tool_"
    thinking, answer, calls = _feed(GemmaToolParser(), text, step)
    assert (thinking, calls) == ("", [])
    assert answer == text  # nothing the model said is lost
