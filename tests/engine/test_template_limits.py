"""Chat templates are code from the Hub: rendering is bounded in output size, work and time, and cancellable;
a prompt that cannot fit the context is refused before it is tokenized whole (issue 19)."""

from __future__ import annotations

import resource
import threading
import time

import pytest

from moechat.engine.chat_template import ChatTemplate
from moechat.engine.errors import ChatTemplateError, GenerationCancelled, PromptTooLongError

HI = [{"role": "user", "content": "hi"}]
NESTED = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{{ k }}{% endfor %}"
          "{% endfor %}{% endfor %}")

HOSTILE = {
    "repeat": ("{{ 'x' * 10**9 }}", "a repeated string would be 1,000,000,000 characters"),
    "list repeat": ("{{ ([1] * 100000) * 100000 }}", "a repeated list would hold 10,000,000,000 items"),
    "nested loops": (NESTED, "template lines without finishing"),
    "doubling +": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                   "a concatenation would be"),
    "doubling ~": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                   "a ~ concatenation would be"),
    "filter width": ("{{ 'x'|center(1000000000) }}", "a call to do_center with 1,000,000,000"),
    "method width": ("{{ 'x'.ljust(999999999) }}", "a call to ljust"),
    "percent width": ("{{ '%1000000000d' % 1 }}", "a width of more than 9,999,999"),
    "format width": ("{{ '{:1000000000}'.format(1) }}", "a width of more than 9,999,999"),
    "replace": ("{{ ('x' * 1000000)|replace('x', 'y' * 2000) }}", "the result of the replace filter would be 2,000,000,000"),
    "join": ("{{ (range(100000)|list)|join('x' * 100000) }}", "a join would be 10,00"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered prompt would be"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
    "memory": ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + ['x' * 4000000] %}"
               "{% endfor %}", "memory past"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_fail_fast_with_a_typed_error(name):
    source, message = HOSTILE[name]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="was stopped") as e:
        ChatTemplate(source).render(HI, max_chars=4_000_000)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - t0 < 30  # in practice well under 3 s; generous for a loaded CI machine
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 1600  # never the gigabytes the unbounded render takes


def test_render_is_cancellable_within_a_moment():
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(GenerationCancelled):
        ChatTemplate(NESTED).render(HI, cancel=cancel)
    assert time.monotonic() - t0 < 5


def test_bounds_leave_real_templates_alone():
    source = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content|trim + '<|im_end|>\\n' }}"
              "{% endfor %}{{ '<|im_start|>assistant\\n' }}")
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 40} for i in range(400)]
    text = ChatTemplate(source).render(messages)
    assert text.count("<|im_start|>") == 401 and text.endswith("assistant\n")


def test_the_sandbox_state_does_not_leak_between_renders():
    """A render that failed leaves no budget or trace function behind."""
    import sys

    before = sys.gettrace()
    with pytest.raises(ChatTemplateError):
        ChatTemplate(HOSTILE["output"][0]).render(HI, max_chars=1000)
    assert sys.gettrace() is before
    assert ChatTemplate("{{ 'x' * 5000 }}").render(HI, max_chars=10_000) == "x" * 5000


# -- the engine: prompts too long for the context ---------------------------------------------------------------

@pytest.fixture
def engine(tiny_chat_model):
    from moechat.engine.generate import Engine

    return Engine.load(tiny_chat_model[0], dtype="float32", context=256)


def test_a_10_mb_prompt_is_refused_before_tokenizing(engine, monkeypatch):
    seen = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **k: seen.append(len(text)) or real(text, **k))
    big = "word " * 2_000_000  # 10 MB
    t0 = time.monotonic()
    with pytest.raises(PromptTooLongError, match="10,000,000 characters, more than a context of 256 tokens"):
        engine.encode_chat([{"role": "user", "content": big}])
    with pytest.raises(PromptTooLongError):
        engine.encode(big)
    assert seen == [] and time.monotonic() - t0 < 1


def test_a_long_prompt_under_the_bound_is_counted_in_pieces(engine, monkeypatch):
    seen = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **k: seen.append(len(text)) or real(text, **k))
    engine.tokenizer.max_token_chars = 1000  # a vocabulary with a 1000-character token: a loose bound
    text = "a b c d " * 20_000  # 160k characters of short tokens: under that bound, far over 256 tokens
    assert len(text) < engine._char_bound()
    with pytest.raises(PromptTooLongError):
        engine.encode(text)
    assert max(seen) <= 1 << 16  # never the whole text at once


def test_cancelling_while_the_template_renders_cancels_the_turn(engine):
    from moechat.engine.chat_template import ChatTemplate as CT

    engine.chat_template = CT("{% for m in messages %}{{ m.content }}{% endfor %}" + NESTED.replace("{{ k }}", ""))
    conversation = engine.conversation()
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    chunks = list(conversation.send("hi", cancel=cancel))
    assert [c.finish_reason for c in chunks] == ["cancelled"] and conversation.messages == []
