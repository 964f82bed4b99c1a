"""Chat templates are code from the Hub: rendering is bounded in output size, work and time, and cancellable;
a prompt that cannot fit the context is refused before it is tokenized whole (issue 19)."""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

import pytest

from moechat.engine.errors import ChatTemplateError, GenerationCancelled, PromptTooLongError
from moechat.engine.text.chat_template import ChatTemplate

HI = [{"role": "user", "content": "hi"}]
NESTED = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{{ k }}{% endfor %}"
          "{% endfor %}{% endfor %}")

HOSTILE = {
    "repeat": ("{{ 'x' * 10**9 }}", "a repeated string would be 1,000,000,000 characters"),
    "list repeat": ("{{ ([1] * 100000) * 100000 }}", "a repeated list would hold 10,000,000,000 items"),
    # the line cap (2M lines, ~7 s on a Zen 2 core), or the 10 s deadline first on a busy machine: either stops it
    "nested loops": (NESTED, ("template lines without finishing", "ran for more than 10 s")),
    "doubling +": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                   "a concatenation would be"),
    "doubling ~": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                   "a ~ concatenation would be"),
    "filter width": ("{{ 'x'|center(1000000000) }}", "a call to do_center with 1,000,000,000"),
    "method width": ("{{ 'x'.ljust(999999999) }}", "a call to ljust"),
    "percent width": ("{{ '%1000000000d' % 1 }}", "a width of more than 9,999,999"),
    "format width": ("{{ '{:1000000000}'.format(1) }}", "a width of more than 9,999,999"),
    "replace": ("{{ ('x' * 1000000)|replace('x', 'y' * 2000) }}",
                "the result of the replace filter would be 2,000,000,000"),
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
    messages = (message,) if isinstance(message, str) else message
    assert any(m in str(e.value) for m in messages) and "\n" not in str(e.value)
    assert time.monotonic() - t0 < 30  # under 3 s for most, ~7 s for the nested loops on a Zen 2 core; generous
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
    from moechat.engine.runtime.generate import Engine

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
    from moechat.engine.text.chat_template import ChatTemplate as CT

    engine.chat_template = CT("{% for m in messages %}{{ m.content }}{% endfor %}" + NESTED.replace("{{ k }}", ""))
    conversation = engine.conversation()
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    chunks = list(conversation.send("hi", cancel=cancel))
    assert [c.finish_reason for c in chunks] == ["cancelled"] and conversation.messages == []


# -- issue 25: every filter and operator bounded before it allocates ---------------------------------------------
#
# Each probe ran on the old code (which sized a value only after the filter returned, and looked at the clock and
# the memory every 256 template lines) for the time and memory noted; now each is refused before it builds.

NESTED_LIST = "{% set a = [range(1000)|list] * 1000 %}"  # 1,000 references to one list of 1,000 lists: 1M ints
BIG = "{% set big = 'x' * 1000000 %}"

PROBES = {
    # the tester's probes (32 s to 90 s+, 1.4-3 GB each on the old code)
    "list * n | string": ("{{ (['a'] * 30000000) | string }}", "a repeated list would hold 30,000,000 items"),
    "list * n | tojson": ("{{ (['a'] * 30000000) | tojson }}", "a repeated list would hold 30,000,000 items"),
    "list * n | sort": ("{{ (['a'] * 30000000) | sort }}", "a repeated list would hold 30,000,000 items"),
    "batch(1) | list": ("{{ ('x' * 30000000) | batch(1) | list }}", "a batch would hold 30,000,000 items"),
    "lipsum": ("{{ lipsum(3000000, false, 20, 100) }}", "would make up to 300,000,000 words"),
    "wordwrap": ("{{ ('hello ' * 5000000) | wordwrap(5) }}", "a text of 30,000,000 characters"),
    # shared sub-lists get past a size check on the operands: the text is sized by a capped walk (old: 1M+ items
    # turned into text inside one C call, ~5 s and ~400 MB for each of these; x10 more with [a] * 10000)
    "nested | string": (NESTED_LIST + "{{ ([a] * 1000) | string }}", "the text of a value would hold"),
    "nested | tojson": (NESTED_LIST + "{{ ([a] * 1000) | tojson }}", "a tojson would hold"),
    "nested | pprint": (NESTED_LIST + "{{ a | pprint }}", "a pprint would hold"),
    "nested output": (NESTED_LIST + "{{ [a] * 1000 }}", "the text of an output value would hold"),
    "nested ~": (NESTED_LIST + "{{ 'x' ~ [a] * 1000 }}", "a ~ concatenation would hold"),
    "nested | join": (NESTED_LIST + "{{ ([a] * 1000) | join(',') }}", "a join would hold"),
    "nested %": (NESTED_LIST + "{{ '%s' % ([a] * 1000,) }}", "a formatted string would hold"),
    "nested | xmlattr": (NESTED_LIST + "{{ {'a': a} | xmlattr }}", "an xmlattr would hold"),
    # filters that made one object per item or word in a C call (old: seconds and ~1-2 GB each)
    "str | list": ("{{ ('x' * 30000000) | list }}", "a list would hold 30,000,000 items"),
    "str | sort": ("{{ ('x' * 30000000) | sort }}", "a sort would hold 30,000,000 items"),
    "str | unique": ("{{ ('x' * 30000000) | unique | list }}", "a unique would hold 30,000,000 items"),
    "str | min": ("{{ ('x' * 30000000) | min }}", "a min would hold 30,000,000 items"),
    "str | map": ("{{ ('x' * 30000000) | map('upper') | list }}", "a map would hold 30,000,000 items"),
    "split()": ("{{ ('x ' * 15000000).split() | length }}", "a split() would hold"),
    "splitlines()": ("{{ ('x\\n' * 15000000).splitlines() | length }}", "a splitlines() would hold"),
    "dict.fromkeys": ("{{ dict.fromkeys('x' * 30000000) }}", "a dict would hold 30,000,000 items"),
    "title": ("{{ ('ab ' * 10000000) | title }}", "a text of 30,000,000 characters"),
    "striptags": ("{{ ('<a>b ' * 6000000) | striptags }}", "a text of 30,000,000 characters"),
    "wordcount": ("{{ ('ab ' * 10000000) | wordcount }}", "a text of 30,000,000 characters"),
    "urlize": ("{{ ('www.a.com ' * 3000000) | urlize }}", "a text of 30,000,000 characters"),
    # growth the old checks missed: a width per line, per tab, per field, per character (old: GBs or MemoryError)
    "indent": ("{{ ('a\\n' * 1000000) | indent(1000) }}", "the result of the indent filter would be 1,002,002,000"),
    "expandtabs()": ("{{ ('\\t' * 1000000).expandtabs(1000) }}", "an expandtabs() would be 1,001,000,000"),
    "format() fields": (BIG + "{{ ('{0}' * 100).format(big) }}", "a formatted string would be 100,000,"),
    "% fields": (BIG + "{{ ('%s' * 100) % ((big,) * 100) }}", "a formatted string would be 100,000,"),
    "format filter": (BIG + "{{ ('%s' * 100) | format(*((big,) * 100)) }}", "a formatted string would be 100,000,"),
    "upper": ("{{ ('ß' * 20000000) | upper }}", "the result of the upper filter would be 60,000,000"),
    "escape": ("{{ ('<' * 20000000) | e }}", "the result of the e filter would be 100,000,000"),
    "strftime_now": ("{{ strftime_now('%c' * 3000000) }}", "a strftime_now() would be 96,000,000"),
    "batch fill_with": ("{{ [1] | batch(1000000, 0) | list }}", "a batch with fill_with would hold 1,000,000"),
    "slice count": ("{{ [1] | slice(1000000) | list }}", "a slice would hold 1,000,000"),
    "range": ("{{ range(10**9) | length }}", "a call to safe_range with 1,000,000,000"),
    # repeated squaring: one multiplication of ~10^8-bit numbers took minutes in C
    "int squaring": ("{% set ns = namespace(x=2) %}{% set ns.x = ns.x ** 60000 %}{% for i in range(30) %}"
                     "{% set ns.x = ns.x * ns.x %}{% endfor %}", "a product would be a number of more than 65,536"),
}


@pytest.mark.parametrize("name", list(PROBES))
def test_a_filter_or_operator_is_refused_before_it_builds(name):
    source, message = PROBES[name]
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="was stopped") as e:
        ChatTemplate(source).render(HI)
    messages = (message,) if isinstance(message, str) else message
    assert any(m in str(e.value) for m in messages) and "\n" not in str(e.value)
    assert time.monotonic() - t0 < 2


def test_sum_of_lists_is_linear():
    """sum(start=[]) copies the growing list once per item (old: 100,000 lists took minutes, quadratic in C); the
    sandbox chains them instead, with the same result."""
    t0 = time.monotonic()
    assert ChatTemplate("{{ ([[1, 2]] * 100000) | sum(start=[]) | length }}").render(HI) == "200000"
    assert ChatTemplate("{{ [[1], [2, 3]] | sum(start=[0]) }}|{{ [(1,), (2,)] | sum(start=()) }}").render(HI) == \
        "[0, 1, 2, 3]|(1, 2)"
    assert time.monotonic() - t0 < 2


def test_bounded_filters_give_jinjas_results():
    """The checks only look: what passes renders as plain Jinja renders it (same filters, same arguments)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = ("{{ [3, 1, 2]|sort }}{{ 'a b c'|wordwrap(3) }}{{ 'ab\\ncd'|indent(2, true) }}{{ [1, 2, 3]|batch(2, 0)"
              "|list }}{{ range(5)|slice(2)|list }}{{ ['x', 'y']|join('-') }}{{ 'hi %s %d'|format('a', 3) }}"
              "{{ '%-5s|' % 'ab' }}{{ '{:>4}'.format(7) }}{{ 'x y'.split() }}{{ {'b': 1, 'a': 2}|dictsort }}"
              "{{ [1, 2, 2]|unique|list }}{{ [1, 2]|map('string')|join }}{{ 'Hello World'|title|center(15) }}"
              "{{ '<b>x</b>'|striptags }}{{ 'a www.x.com'|urlize }}{{ 'a b'|wordcount }}{{ [1, [2]]|string }}"
              "{{ ('ab' * 3)|replace('b', 'cd', 2) }}{{ 'x'|truncate(5) }}{{ [1, 2]|sum }}{{ 'abc'|reverse }}"
              "{{ [{'a': 1}, {'a': 0}]|groupby('a')|list }}{{ {'k': 'v'}|xmlattr }}{{ 'a&b'|urlencode }}"
              "{{ [1, {'a': (2, 3)}]|pprint }}{{ 'a\\tb'.expandtabs(4) }}{{ 'ß'|upper }}{{ [1, 2] ~ (3,) }}")
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source).render()
    assert ChatTemplate(source).render(HI) == plain


def test_a_slow_loop_of_bounded_calls_is_stopped_by_the_watchdog(monkeypatch):
    """Each sort here takes ~0.1 s: the old code looked at the clock every 256 lines, ~13 s of sorting; the
    watchdog flags the deadline and the next line or hook stops the render."""
    from moechat.engine.text.chat_template import limits

    monkeypatch.setattr(limits, "MAX_RENDER_SECONDS", 0.5)
    source = "{% for i in range(100000) %}{% set x = (range(100000)|list)|sort(reverse=true) %}{% endfor %}"
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="ran for more than 0.5 s"):
        ChatTemplate(source).render(HI)
    assert time.monotonic() - t0 < 2


# -- limits that leave real templates alone ---------------------------------------------------------------------

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"
TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": "Look something up. " * 10,
    "parameters": {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "description": "what to look up"},
        "limit": {"type": "integer", "description": "how many results", "enum": [1, 5, 10]},
        "filters": {"type": "array", "items": {"type": "string"}}}}}} for i in range(8)]
TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def _long_chat(n: int = 500) -> list[dict]:
    text = "The quick brown fox jumps over the lazy dog; \"quoted\" and {braced} 100% \u00e9t\u00e9 \u4f60\u597d.\n"
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"[{i}] " + text * 25} for i in range(n)]


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/chat-templates is not here")
@pytest.mark.parametrize("path", sorted(SHARED.glob("*.jinja")) if SHARED.is_dir() else [], ids=lambda p: p.stem)
def test_a_500_message_chat_with_tools_renders_through_real_templates(path):
    messages = _long_chat()
    assert all(1900 < len(m["content"]) < 2200 for m in messages)  # 2 KB each
    template = ChatTemplate(path.read_text(), TOKENS)
    text = template.render(messages, tools=TOOLS)
    assert all(f"[{i}] " in text for i in (0, 250, 499)), path.name
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {word: i for i, word in enumerate(TOKENS.values())}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                              chat_template=path.read_text(), **TOKENS)
    expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    if "strftime_now" not in template.source:  # a date may tick over between the two renders
        assert text == expected


def test_a_500_message_chat_through_tojson_and_loops_renders():
    source = ("{{ tools | tojson(indent=2) }}{% for m in messages %}{{ m | tojson }}"
              "{{ m.content.split('\\n') | length }}"
              "{% for line in m.content.splitlines() %}{{ line | trim | upper | length }}{% endfor %}"
              "{{ m.content | replace('fox', 'cat') | wordcount }}{% endfor %}{{ messages | map(attribute='role')"
              " | unique | list | join(',') }}{{ messages | selectattr('role', 'eq', 'user') | list | length }}")
    text = ChatTemplate(source).render(_long_chat(), tools=TOOLS)
    assert text.endswith("user,assistant250") and text.count('"role": "user"') == 250


# -- fuzzing: random expressions end quickly, in text or the typed error ------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402 - the fuzzing section's own imports
from hypothesis import strategies as st  # noqa: E402

_LITERALS = st.sampled_from(["0", "3", "1000", "100000", "10**6", "''", "'a'", "'ab c-d'", "'x\\n\\ty'", "'ß<&>'",
                             "'%s'", "'{}'", "('ab ' * 50000)", "(range(1000) | list)", "[1, 'a']", "[[1], [2, 3]]",
                             "{'k': [1, 2]}", "range(100000)",
                             "none", "true", "2.5", "messages", "lipsum(2, false, 5, 10)",
                             "lipsum(1000, false, 5, 1000)", "namespace(a=[1])", "dict(a='b')"])
_FILTERS = st.sampled_from([
    "string", "tojson", "tojson(indent=2)", "pprint", "sort", "list", "join(',')", "join", "batch(2)", "batch(3, 0)",
    "slice(3)", "unique", "reverse", "upper", "lower", "title", "capitalize", "trim", "wordwrap(3)", "center(50)",
    "indent(2)", "replace('a', 'bb')", "truncate(5)", "map('string')", "map('upper')", "sum", "length", "first",
    "last", "min", "max", "dictsort", "items", "wordcount", "striptags", "urlize", "escape", "urlencode", "int",
    "float", "abs", "round", "list | length", "select", "reject", "unique | list", "xmlattr", "groupby(0)",
    "format(1, 2)", "default('d')", "count", "safe", "filesizeformat", "attr('x')", "random | string",
])


def _expressions():
    def extend(inner):
        return st.one_of(
            st.tuples(inner, st.sampled_from(["*", "+", "~", "%", "**", "-", "//", "in"]), inner).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(inner, _FILTERS).map(lambda t: f"({t[0]} | {t[1]})"),
            st.tuples(inner, st.sampled_from(["split()", "split('a')", "splitlines()", "upper()", "strip()",
                                               "replace('a', 'xyz')", "expandtabs(100)", "join(['a', 'b'])",
                                               "format(1, 'a')", "center(1000)", "ljust(100)", "count('a')"])
                      ).map(lambda t: f"({t[0]}).{t[1]}"),
            st.tuples(inner, inner).map(lambda t: f"[{t[0]}, {t[1]}]"),
        )
    return st.recursive(_LITERALS, extend, max_leaves=8)


@settings(max_examples=300, deadline=2500, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(_expressions())
def test_random_expressions_end_fast_with_text_or_the_typed_error(expression):
    t0 = time.monotonic()
    try:
        result = ChatTemplate("{{ " + expression + " }}").render(HI, max_chars=200_000)
    except ChatTemplateError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(result, str) and len(result) <= 200_000
    assert time.monotonic() - t0 < 2
