"""The engine's public API: load a model, stream generations as immutable chunks, keep conversations.

    engine = Engine.load("path/to/model")
    for chunk in engine.generate(engine.encode_chat([{"role": "user", "content": "hi"}])):
        print(chunk.text, end="")

`generate` is a generator of frozen `GenerationChunk`s (text delta, token ids, finish reason,
prefill/decode tok/s): the CLI prints them, the TUI posts them as messages, a server would send them
as events. It knows nothing of any UI. Given a reasoning parser (`Engine.reasoning_parser`, from the
chat template's format: gpt-oss's harmony channels or `<think>` tags), a chunk's `text` is the answer
and its `thinking` the model's reasoning; a conversation records both. Cancellation is a
`threading.Event` checked between tokens, so a stop takes effect within one decode step.

A `Conversation` owns a KV cache and the token ids in it. Each turn renders the whole conversation
with the chat template, keeps the longest prefix that is already in the KV cache and prefills only the
rest: a 10-turn chat prefills each turn's new tokens, not the whole history (templates that rewrite
earlier turns, like Qwen3 dropping old reasoning, just share a shorter prefix).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache.prefetch import Predictor, profile_path, save_profile
from ..cache.provider import CacheConfig, build_cached_provider
from ..cache.stats import CacheSnapshot
from ..errors import (
    ChatTemplateError,
    ConfigError,
    GenerationCancelled,
    MoechatError,
    NonFiniteLogitsError,
    PromptTooLongError,
    TokenizerError,
    typed_errors,
)
from ..io.checkpoint import read_json
from ..io.validate import check_generation_config
from ..layers.experts import forget_views
from ..layers.kv_cache import KVCache
from ..layers.moe import ExpertProvider
from ..load.loader import LoadedModel, load_model
from ..text.chat_template import ChatTemplate
from ..text.reasoning import ReasoningDelta, ReasoningParser, make_parser, reasoning_format, thinking_switch
from ..text.tokenizer import IncrementalDetokenizer, Tokenizer
from .sampling import Sampler, SamplingParams

DEFAULT_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 512  # on a GPU (the memory plan's activations are sized for it); a CPU's is measured
# Prompt tokens decoded to tell where a reasoning parser starts: "<|start|>assistant" or "<think>\n" is 2-3.
_PROMPT_TAIL_TOKENS = 8
_SNAPSHOT_BACK = 8  # recurrent state: a snapshot this many tokens before a prompt's end (see Engine._forward)
_PIECE_CHARS = 1 << 16  # a long prompt is counted in pieces this big before it is tokenized whole


@dataclass(frozen=True)
class GenerationChunk:
    """One step of a generation, as the UI and the CLI see it."""

    text: str  # new text since the previous chunk (may be "" while a UTF-8 sequence is incomplete)
    token_ids: tuple[int, ...]  # tokens sampled in this step
    finish_reason: str | None = None  # None while running, then "stop", "length" or "cancelled"
    prompt_tokens: int = 0  # tokens prefilled for this generation (new ones only, in a conversation)
    generated_tokens: int = 0  # tokens generated so far
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    cache: CacheSnapshot | None = None  # on the last chunk, when the experts are cached
    thinking: str = ""  # new reasoning text, split off `text` when generating with a reasoning parser
    # with generate(logprobs=k): the sampled token's log-probability under the model's raw logits (before
    # temperature and penalties, as vLLM reports them) and the k most likely (token id, log-probability), best first
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class SequenceState:
    """A KV cache (and the recurrent layers' states) and the token ids whose keys, values and states it holds."""

    kv: KVCache
    tokens: list[int] = field(default_factory=list)

    def truncate(self, n: int) -> int:
        """Keep the first n tokens, or fewer where a recurrent state has no snapshot at n: returns how many are kept
        (prefill from there)."""
        n = self.kv.truncate(n)
        del self.tokens[n:]
        return n


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def default_prefill_chunk(loaded: LoadedModel) -> int:
    """Tokens per prefill chunk when none is given: on a CPU, the most whose fp32 activations stay in its
    last-level cache (quant/prefill.machine_chunk_size, read from sysfs); on a GPU, DEFAULT_PREFILL_CHUNK. Chunking
    never changes the tokens (tests/engine/test_prefill_chunk.py)."""
    if loaded.device.type != "cpu":
        return DEFAULT_PREFILL_CHUNK
    from ..quant.prefill import machine_chunk_size

    a = loaded.args
    hidden = int(getattr(a, "hidden_size", 0) or 0)
    inter = int(getattr(a, "moe_intermediate_size", None) or getattr(a, "intermediate_size", 0) or 0)
    return machine_chunk_size(hidden, inter) if hidden > 0 else DEFAULT_PREFILL_CHUNK


class Engine:
    """A loaded model with its tokenizer, chat template and generation defaults."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer | None, chat_template: ChatTemplate | None,
                 generation_config: dict, context: int, prefill_chunk: int | None = None,
                 provider: ExpertProvider | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.args = loaded.args
        self.provider = provider or loaded.provider
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.generation_config = generation_config
        self.context = context
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(loaded)  # tokens per forward pass in prefill
        self.profile_path: Path | None = None  # where this model's routing profile is saved (cached only)
        self.notices: list[str] = []  # what a user should know about this model, a line each (CLI and app show them)
        eos = _ids(generation_config.get("eos_token_id")) + _ids(loaded.args.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    @classmethod
    @typed_errors("loading the model")
    def load(cls, model_dir: str | os.PathLike, *, dtype: str | None = None, device: str = "cpu",
             context: int | None = None, prefill_chunk: int | None = None,
             cache: CacheConfig | None = None, expert_format: str | None = None,
             dense_format: str | None = None) -> Engine:
        """Load a model directory. With `cache`, experts go to a slot pool over RAM/disk tiers; `expert_format`
        int8/int4 holds them quantized in every tier (None or `native`: as the checkpoint ships them);
        `dense_format` int8 holds attention's projections and the LM head in int8 (CPU; quant/dense_int8.py)."""
        model_dir = Path(model_dir)
        from ..load.gguf import gguf_text, is_gguf

        if is_gguf(model_dir):  # a .gguf file (a split's first, a folder holding one): text from its metadata
            generation_config, tokenizer, template = gguf_text(model_dir)
        elif not model_dir.is_dir():
            raise ConfigError(f"{model_dir}: no such model directory")
        else:
            # The small files first: a bad generation_config.json or tokenizer file fails before any weight is read.
            gen_path = model_dir / "generation_config.json"
            generation_config = (check_generation_config(read_json(gen_path, "generation config"), str(gen_path))
                                 if os.path.lexists(gen_path) else {})
            tokenizer = Tokenizer.from_model_dir(model_dir) if os.path.lexists(model_dir / "tokenizer.json") else None
            template = ChatTemplate.from_model_dir(model_dir)
        if template is not None and tokenizer is not None and not is_gguf(model_dir):
            template = ChatTemplate.from_string(template.source, {**tokenizer.special_tokens,
                                                                   **template.special_tokens})
        loaded = load_model(model_dir, dtype=dtype, device=device, max_positions=context or DEFAULT_CONTEXT,
                            dense_format=dense_format,
                            resident_experts=cache is None, expert_format=expert_format,
                            repack_dir=cache.repack_dir if cache is not None else None)
        # a tokenizer with ids past the embedding is refused; one far smaller than it gets a notice
        notice = tokenizer.check_fits(loaded.args.vocab_size, str(model_dir)) if tokenizer is not None else None
        context = loaded.model.max_positions  # clamped to the model's own maximum
        if loaded.expert_format.name != "dense" or loaded.model.dense_format != "native" or (
                loaded.device.type == "cpu" and loaded.dtype == torch.bfloat16):
            # Packed experts run on the CPU (a CPU engine, or host misses), and bf16 decode attention on a CPU:
            # build or load the native kernels now, not in the first token (the first build on a machine compiles
            # for 1-3 s; a cached one loads in ~5 ms).
            from ..quant import native

            native.library()
        provider = None
        if cache is not None:
            if cache.embeddings == "host":  # before the slots are allocated: the table's VRAM is theirs
                loaded.model.embed_on_host()
            provider = build_cached_provider(loaded.cls, loaded.args, loaded.checkpoint, loaded.dtype,
                                             loaded.device, cache, loaded.expert_format, loaded.native_format)
            if os.environ.get("MOECHAT_DEVICE_STEP") == "1":  # the device-resident MoE step (issue 32), opt-in
                from ..cache.provider.device import device_step_or_reason

                provider, step_notice = device_step_or_reason(provider)
                notice = "; ".join(n for n in (notice, step_notice) if n) or None
        engine = cls(loaded, tokenizer, template, generation_config, context, prefill_chunk, provider)
        engine.notices.extend(n for n in (notice,) if n)
        if (skipped := getattr(loaded.cls, "load_notice", None)) is not None:  # e.g. a vision tower not loaded
            engine.notices.extend(n for n in (skipped(loaded.raw_config, loaded.checkpoint),) if n)
        if provider is not None:
            provider.set_predictor(Predictor.from_model(loaded.model))
            engine.profile_path = profile_path(model_dir, cache.profile_dir)
            if cache.warm_start:  # the saved profile, else an imatrix beside the model; or imatrix:FILE
                from ..cache.imatrix import warm_start_counts

                counts, note = warm_start_counts(cache.warm_start, engine.profile_path, model_dir,
                                                 loaded.args.num_hidden_layers, loaded.args.num_experts)
                engine.notices.extend(n for n in (note,) if n)
                if counts is not None:
                    provider.warm_start(counts)
        return engine

    def save_routing_profile(self) -> Path | None:
        """Merge this run's expert usage into the model's saved profile (what --warm-start reads)."""
        from ..cache.provider import CachedProvider

        provider = self.provider
        if not isinstance(provider, CachedProvider) or self.profile_path is None or not provider.frequency.any():
            return None
        try:
            save_profile(self.profile_path, provider.frequency)
        except OSError:
            return None  # a cache dir we cannot write is not worth failing a run for
        return self.profile_path

    def close(self) -> None:
        """Stop in-flight expert loads and save the routing profile; the engine stays usable."""
        quiesce = getattr(self.provider, "quiesce", None)
        if quiesce is not None:
            quiesce()
        self.save_routing_profile()
        forget_views()  # the memoised per-expert views hold this engine's buffers (~a model's experts a load)

    # -- text <-> ids ---------------------------------------------------------------------------
    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(f"{self.loaded.model_dir}: has no tokenizer.json, so text prompts cannot be "
                                 "encoded; pass token ids with --prompt-ids")
        return self.tokenizer

    @typed_errors("tokenizing the prompt")
    def encode(self, text: str) -> list[int]:
        """A raw prompt, with the tokenizer's own special tokens (e.g. BOS)."""
        return self._encode_bounded(text, "prompt", add_special_tokens=True)

    def _char_bound(self) -> int:
        """Characters that cannot fit the context whatever they say: context x the longest token x 4 (slack for
        normalizers that drop characters). A prompt past it is refused without tokenizing it."""
        return self.context * self._need_tokenizer().max_token_chars * 4

    def _encode_bounded(self, text: str, what: str, *, add_special_tokens: bool) -> list[int]:
        """Tokenize, refusing a text that cannot fit the context before tokenizing it whole: a 10 MB paste costs
        milliseconds, not 30 s and gigabytes. Past the sound bound (`_char_bound`) at once; a long text under it
        is counted in 64k-character pieces first, refused once they hold twice the context (a piece boundary
        changes a count by a token or two, never by half)."""
        tokenizer = self._need_tokenizer()
        bound = self._char_bound()
        too_long = PromptTooLongError(f"the {what} is {len(text):,} characters, more than a context of "
                                      f"{self.context:,} tokens can hold: shorten it, start a new chat, or raise "
                                      "--context")
        if len(text) > bound:
            raise too_long
        if len(text) > _PIECE_CHARS:
            counted = 0
            for start in range(0, len(text), _PIECE_CHARS):
                counted += len(tokenizer.encode(text[start : start + _PIECE_CHARS], add_special_tokens=False))
                if counted > 2 * self.context:
                    raise too_long
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @typed_errors("rendering the chat prompt")
    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    cancel: threading.Event | None = None, **template_kwargs) -> list[int]:
        """Render with the model's chat template and tokenize as transformers' apply_chat_template does.
        Rendering is bounded and stops when `cancel` is set (GenerationCancelled); a conversation that cannot
        fit the context is refused before it is rendered or tokenized."""
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.loaded.model_dir}: the model has no chat template; use --raw to send "
                                    "the prompt as plain text")
        chars = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
        if chars > self._char_bound():
            raise PromptTooLongError(f"the conversation is {chars:,} characters, more than a context of "
                                     f"{self.context:,} tokens can hold: shorten it, start a new chat, or raise "
                                     "--context")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, cancel=cancel,
                                         **template_kwargs)
        return self._encode_bounded(text, "chat prompt", add_special_tokens=False)

    def reasoning_parser(self, prompt_ids: Sequence[int]) -> ReasoningParser | None:
        """A parser splitting thinking from the answer for a reply to this chat prompt; None when the model's
        template has no reasoning format (or there is no tokenizer to turn ids into text)."""
        fmt = reasoning_format(self.chat_template.source if self.chat_template is not None else None)
        if fmt is None or self.tokenizer is None:
            return None
        return make_parser(fmt, self.tokenizer.decode(list(prompt_ids)[-_PROMPT_TAIL_TOKENS:]))

    def template_reads(self, variable: str) -> bool:
        """Whether the chat template uses `variable` (e.g. reasoning_effort), so passing it changes the prompt."""
        return self.chat_template is not None and variable in self.chat_template.variables

    def thinking_kwargs(self, on: bool | None) -> dict:
        """The chat template variable that turns thinking on or off ({"enable_thinking": on} for Qwen, GLM,
        Nemotron and Gemma 4; {"thinking": on} for DeepSeek-V3.1); {} when `on` is None (the template's default)
        or the template has no such switch."""
        if on is None or self.chat_template is None:
            return {}
        name = thinking_switch(self.chat_template.variables)
        return {} if name is None else {name: bool(on)}

    def sampling(self, **overrides) -> SamplingParams:
        """The model's generation_config.json defaults with the given overrides."""
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    def default_max_tokens(self) -> int:
        return int(self.generation_config.get("max_new_tokens") or 512)

    # -- generation -----------------------------------------------------------------------------
    def new_sequence(self) -> SequenceState:
        a = self.args
        return SequenceState(KVCache.for_model(a, self.context, self.loaded.dtype, self.loaded.device))

    def _forward(self, seq: SequenceState, ids: Sequence[int]) -> torch.Tensor:
        """Run ids through the model (chunked), append them to seq; last position's fp32 logits [V].

        With recurrent layers a prompt's prefill stops once, _SNAPSHOT_BACK tokens before its end, for a snapshot of
        their state: the next turn's shared prefix ends about there when the template renders this turn's opening
        differently in the history (Qwen3.5 drops the reply's <think> block), and never past the prompt's end."""
        hidden = None
        cut = max(0, len(ids) - _SNAPSHOT_BACK) if len(ids) > 1 and seq.kv.recurrent_layers else len(ids)
        for part, (lo, hi) in enumerate(((0, cut), (cut, len(ids)))):
            if part == 1 and hi > lo:
                seq.kv.snapshot()
            for i in range(lo, hi, self.prefill_chunk):
                chunk = list(ids[i : min(hi, i + self.prefill_chunk)])
                hidden = self.model(torch.tensor(chunk, dtype=torch.long, device=self.loaded.device), seq.kv,
                                    self.provider)  # [T, H]
                seq.tokens.extend(chunk)
        logits = self.model.logits(hidden[-1:])[0]  # [V]
        if (settle := getattr(self.provider, "finish_step", None)) is not None:
            settle()  # the device-resident step's admission and eviction, between tokens (after lm_head is enqueued)
        return logits

    @typed_errors("generating")
    def generate(self, prompt_ids: Sequence[int], *, sampling: SamplingParams | None = None,
                 max_tokens: int | None = None, cancel: threading.Event | None = None,
                 sequence: SequenceState | None = None, stop_on_eos: bool = True,
                 reasoning: ReasoningParser | None = None, logprobs: int | None = None) -> Iterator[GenerationChunk]:
        """Prefill prompt_ids (after whatever `sequence` already holds) and stream generated tokens.

        With `reasoning` (see `reasoning_parser`), each chunk's text is split into `thinking` and `text`. With
        `logprobs` = k (0..20), each token's chunk carries its log-probability and the k best alternatives, read in
        the same host sync as the token (a log_softmax and a top-k over the vocabulary: microseconds on a GPU).
        """
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise MoechatError(f"logprobs must be 0..20, got {logprobs}")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise MoechatError("the prompt is empty: give at least one token")
        vocab = self.args.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise MoechatError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        seq = sequence if sequence is not None else self.new_sequence()
        seq.kv.reserve(len(prompt_ids))
        sampling = sampling or self.sampling()
        max_tokens = self.default_max_tokens() if max_tokens is None else max_tokens
        detok = None
        if self.tokenizer is not None:
            keep = reasoning.markers if reasoning is not None else ()
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids, keep=keep)
        stop_ids = self.eos_token_ids if stop_on_eos else frozenset()
        penalise = sampling.repetition_penalty != 1.0
        history = seq.tokens[:]

        try:
            yield from self._generate(seq, prompt_ids, sampling, max_tokens, cancel, detok, stop_ids, penalise,
                                      history, reasoning, logprobs)
        finally:
            # Done, cancelled or abandoned: no expert load may outlive the request.
            quiesce = getattr(self.provider, "quiesce", None)
            if quiesce is not None:
                quiesce()

    def _generate(self, seq, prompt_ids, sampling, max_tokens, cancel, detok, stop_ids, penalise,
                  history, reasoning, logprobs=None) -> Iterator[GenerationChunk]:
        sampler = Sampler(sampling, device=self.loaded.device)
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = self._forward(seq, prompt_ids)
            history.extend(prompt_ids)
            t_first = time.perf_counter()
            prefill_rate = len(prompt_ids) / max(t_first - t0, 1e-9)
            generated: list[int] = []
            if penalise:  # the ids seen so far, in one buffer filled as tokens come (no per-token copy of history)
                seen = torch.empty(len(history) + min(max_tokens, seq.kv.free) + 1, dtype=torch.long,
                                   device=self.loaded.device)  # [N]
                seen[: len(history)] = torch.tensor(history, dtype=torch.long)
            n_seen = len(history)
            while True:
                token, lp = self._sample(sampler, logits, seen[:n_seen] if penalise else None, len(generated),
                                         logprobs)
                generated.append(token)
                history.append(token)
                if penalise:
                    seen[n_seen] = token
                n_seen += 1
                finish = None
                if token in stop_ids:
                    finish = "stop"
                elif len(generated) >= max_tokens or seq.kv.free == 0:
                    finish = "length"
                elif cancel is not None and cancel.is_set():
                    finish = "cancelled"
                text = "" if detok is None or token in stop_ids else detok.add(token)
                if finish is not None and detok is not None:
                    text += detok.flush()
                thinking = ""
                if reasoning is not None:
                    delta = reasoning.feed(text)
                    if finish is not None:
                        rest = reasoning.flush()
                        delta = ReasoningDelta(delta.thinking + rest.thinking, delta.answer + rest.answer)
                    text, thinking = delta.answer, delta.thinking
                now = time.perf_counter()
                decode_rate = (len(generated) - 1) / (now - t_first) if len(generated) > 1 else 0.0
                yield GenerationChunk(text, (token,), finish, len(prompt_ids), len(generated), prefill_rate,
                                      decode_rate, self.cache_snapshot() if finish else None, thinking,
                                      *(lp or (None, ())))
                if finish is not None:
                    return
                if cancel is not None and cancel.is_set():
                    yield GenerationChunk("", (), "cancelled", len(prompt_ids), len(generated), prefill_rate,
                                          decode_rate, self.cache_snapshot())
                    return
                logits = self._forward(seq, [token])

    def _sample(self, sampler: Sampler, logits: torch.Tensor, seen: torch.Tensor | None, step: int,
                logprobs: int | None = None) -> tuple[int, tuple | None]:
        """The next token id, read in the one host sync per token together with the logits' min and max: NaN or
        Inf logits (damaged weights, an fp16 overflow) end the generation with a typed error, where argmax over
        NaN would return an arbitrary token, often a stop that looks like a normal end. With `logprobs` = k, the
        token's log-probability and the k best (id, log-probability) come back in the same sync."""
        lo, hi = torch.aminmax(logits)  # [] [] (aminmax propagates NaN)
        sampled = sampler(logits, seen)  # [] int64
        token = torch.as_tensor(sampled, dtype=torch.float64, device=logits.device)  # []
        parts = [token.reshape(1), lo.double().reshape(1), hi.double().reshape(1)]
        if logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)  # [V]
            top_v, top_i = torch.topk(lp, logprobs)  # [k] [k]
            parts += [lp[torch.as_tensor(sampled, device=lp.device).long()].double().reshape(1), top_v.double(),
                      top_i.double()]
        values = torch.cat(parts).tolist()
        token, lo, hi = values[:3]
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise NonFiniteLogitsError(
                f"the model produced NaN or Inf logits at generated token {step + 1}: its numbers overflowed or its "
                f"weights are damaged; the reply was stopped there. Try --dtype bfloat16 or float32 (now "
                f"{str(self.loaded.dtype).removeprefix('torch.')}), or download the model again")
        if logprobs is None:
            return int(token), None
        k = logprobs
        top = tuple((int(i), v) for v, i in zip(values[4 : 4 + k], values[4 + k : 4 + 2 * k], strict=True))
        return int(token), (values[3], top)

    def retune_cache(self, *, expert_slots: int | None = None, policy: str | None = None,
                     ram_cache_bytes: int | None = None, prefetch: str | None = None,
                     prefetch_depth: int | None = None) -> CacheSnapshot:
        """Change the expert cache without reloading the model; call it between tokens (a safe point).

        A resident model becomes cached on the first call. Slots carry their experts over, best ranked
        first; a new RAM budget starts that tier empty.
        """
        from ..cache.provider import CachedProvider
        from ..cache.ram_tier import RamCache, RamStore

        loaded = self.loaded
        if not isinstance(self.provider, CachedProvider):
            config = CacheConfig(expert_slots=expert_slots, policy=policy or CacheConfig.policy,
                                 ram_cache_bytes=ram_cache_bytes)
            self.provider = build_cached_provider(loaded.cls, loaded.args, loaded.checkpoint, loaded.dtype,
                                                  loaded.device, config, loaded.expert_format,
                                                  loaded.native_format)
            self.provider.set_predictor(Predictor.from_model(loaded.model))
            self.profile_path = profile_path(loaded.model_dir)
            loaded.provider = None  # the resident experts are released
            if prefetch is not None or prefetch_depth is not None:
                self.provider.set_prefetch(prefetch or self.provider.prefetch_mode, prefetch_depth)
            return self.provider.snapshot()
        provider = self.provider
        if policy is not None:
            provider.set_policy(policy)
        if expert_slots is not None and expert_slots != provider.pool.num_slots:
            provider.resize(expert_slots)
        if ram_cache_bytes is not None and ram_cache_bytes != getattr(provider.store, "budget_bytes", None):
            provider.quiesce()  # no load may be reading the store being replaced
            disk = provider.store.disk
            layers = loaded.cls.moe_layers(loaded.args)
            all_bytes = disk.expert_bytes * len(layers) * loaded.args.num_experts
            provider.store = (RamStore(disk, layers, loaded.args.num_experts) if ram_cache_bytes >= all_bytes
                              else RamCache(disk, ram_cache_bytes, policy=provider.policy.name))
            provider.ram_prefetched.clear()
            if provider.fast_tier == "ram" and provider.prefetch_mode != "off" and isinstance(provider.store, RamStore):
                provider.set_prefetch("off")  # every expert in RAM on a CPU: nothing left to read ahead
        if prefetch is not None or prefetch_depth is not None:  # after the RAM tier: whether it can act depends on it
            provider.set_prefetch(prefetch or provider.prefetch_mode, prefetch_depth)
        return provider.snapshot()

    def cache_snapshot(self) -> CacheSnapshot | None:
        """The expert cache right now (None when every expert is resident)."""
        snapshot = getattr(self.provider, "snapshot", None)
        return snapshot() if snapshot is not None else None

    def conversation(self, system: str | None = None, *, overflow: str = "drop-oldest") -> Conversation:
        return Conversation(self, system, overflow=overflow)

    def context_advice(self) -> str:
        """What a user can do about a full context: raise --context only while the model allows more."""
        most = int(getattr(self.args, "max_position_embeddings", 0) or 0)
        if most > self.context:
            return f"start a new chat, or raise --context (this model allows up to {most:,})"
        return f"start a new chat ({self.context:,} tokens is this model's maximum)"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


OVERFLOW = ("drop-oldest", "error")


class Conversation:
    """A chat whose KV cache persists across turns; each turn prefills only its new tokens.

    A conversation outgrows the context. With `overflow="drop-oldest"` (the chat app's way) a turn whose
    prompt plus room for the reply (`reply_reserve`) does not fit leaves the oldest whole turns (a user message
    and what followed it) out of what the model sees, never the system prompt or the new message; they are kept
    in `forgotten`, and `dropped_turns` says how many the last `send` left out. A new message that cannot fit
    even alone is a PromptTooLongError that says so. `overflow="error"` (an API caller, whose request is the
    whole conversation) refuses instead.
    """

    def __init__(self, engine: Engine, system: str | None = None, *, overflow: str = "drop-oldest"):
        if overflow not in OVERFLOW:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")
        self.engine = engine
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.sequence = engine.new_sequence()
        self.last_prefill_tokens = 0
        self.overflow = overflow
        self.dropped_turns = 0  # oldest turns the last send left out of the prompt
        self.forgotten: list[dict] = []  # every message left out so far, oldest first

    def reply_reserve(self, max_tokens: int | None) -> int:
        """Context positions kept free for the reply when fitting the prompt: the reply's limit, at most a
        quarter of the context (a longer reply then ends "length", as it would have anyway)."""
        limit = self.engine.default_max_tokens() if max_tokens is None else max_tokens
        return max(1, min(int(limit), self.engine.context // 4))

    def _oldest_turn(self) -> tuple[int, int] | None:
        """[start, end) of the oldest whole turn before the new message (the last one), or None."""
        users = [i for i, m in enumerate(self.messages) if m.get("role") == "user"]
        if len(users) < 2:
            return None
        return users[0], users[1]

    def _fit(self, ids: list[int], max_tokens: int | None, cancel, template_kwargs) -> list[int]:
        """`ids` for the conversation, leaving out the oldest turns while prompt + reserve overflow."""
        context, reserve = self.engine.context, self.reply_reserve(max_tokens)
        self.dropped_turns = 0
        while len(ids) + reserve > context:
            cut = self._oldest_turn() if self.overflow == "drop-oldest" else None
            if cut is None:
                if len(ids) < context:
                    break  # what is left fits, with less room for the reply: it may end "length" sooner
                raise PromptTooLongError(self._too_long(ids, context))
            a, b = cut
            self.forgotten += self.messages[a:b]
            del self.messages[a:b]
            self.dropped_turns += 1
            ids = self.engine.encode_chat(self.messages, add_generation_prompt=True, cancel=cancel,
                                          **template_kwargs)
        return ids

    def _too_long(self, ids: list[int], context: int) -> str:
        """Why a prompt that cannot fit even alone is refused: the sizes (the new message against the room the
        conversation so far leaves it; an API caller's whole conversation against the context), and the fix."""
        most = int(getattr(self.engine.args, "max_position_embeddings", 0) or 0)
        fix = (f"raise --context (the model allows {most:,}) or shorten it" if most > context
               else f"shorten it ({context:,} tokens is this model's maximum)")
        if self.overflow != "drop-oldest":
            return (f"the conversation is {len(ids):,} tokens; the context of {context:,} holds {context - 1:,} "
                    f"with a token of reply: {fix}")
        # the message's own tokens; the rest of the prompt (system prompt, template) is the conversation so far
        message = min(len(self.engine.encode(str(self.messages[-1].get("content") or ""))), len(ids))
        room = max(0, context - 1 - (len(ids) - message))
        return (f"this message is {message:,} tokens; the context of {context:,} leaves room for {room:,} after the "
                f"conversation so far: {fix}")

    def send(self, content: str, *, sampling: SamplingParams | None = None, max_tokens: int | None = None,
             cancel: threading.Event | None = None, **template_kwargs) -> Iterator[GenerationChunk]:
        """Add a user message, stream the assistant's reply, then record it in `messages`.

        The reply is recorded as `content`, its reasoning (when the template has a format for it) as
        `thinking`, which is where templates read it back from (gpt-oss refuses channel markers in content).
        """
        self.messages.append({"role": "user", "content": content})
        before = list(self.messages), list(self.forgotten)
        try:
            ids = self.engine.encode_chat(self.messages, add_generation_prompt=True, cancel=cancel, **template_kwargs)
            ids = self._fit(ids, max_tokens, cancel, template_kwargs)
        except GenerationCancelled:  # stopped while the template rendered: a cancelled turn, not an error
            (self.messages, self.forgotten), self.dropped_turns = before, 0
            self.messages.pop()
            yield GenerationChunk("", (), "cancelled")
            return
        except MoechatError:
            (self.messages, self.forgotten), self.dropped_turns = before, 0
            self.messages.pop()
            raise
        # Reuse the cached prefix; at least one token must be fed to get logits.
        keep = self.sequence.truncate(min(_common_prefix(self.sequence.tokens, ids), len(ids) - 1))
        self.last_prefill_tokens = len(ids) - keep
        reply: list[str] = []
        thinking: list[str] = []
        started = False

        def record() -> None:
            message = {"role": "assistant", "content": "".join(reply)}
            if any(thinking):
                message["thinking"] = "".join(thinking)
            self.messages.append(message)

        try:
            for chunk in self.engine.generate(ids[keep:], sampling=sampling, max_tokens=max_tokens, cancel=cancel,
                                              sequence=self.sequence, reasoning=self.engine.reasoning_parser(ids)):
                started = True
                reply.append(chunk.text)
                thinking.append(chunk.thinking)
                yield chunk
        except MoechatError:
            if not started:  # refused before any token (e.g. too long): the turn never happened
                self.messages.pop()
                raise
            record()
            raise
        else:
            record()
        finally:
            # A consumer that stops iterating early (GeneratorExit) keeps the partial reply: nothing is lost.
            if started and self.messages[-1]["role"] != "assistant":
                record()
