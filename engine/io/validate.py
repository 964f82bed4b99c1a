"""One validation layer for the JSON files of a model directory: declared rules, one typed line per violation.

What it checks: config.json (per architecture), generation_config.json, tokenizer_config.json and the
safetensors index. A violation is a `ConfigError` (or, for the index, a `CheckpointError`) whose message
names the file, the key, the value and what is allowed:

    /models/x/config.json: num_key_value_heads = 0 is not allowed: must be an integer in 1..1,024

How rules are declared (no check is written by hand per model file):

* `COMMON` maps the config.json keys whose meaning is the same in every Hugging Face model type
  (`num_hidden_layers`, `rope_theta`, `eos_token_id`...) to a `Rule`: type, range, nullability. Its caps
  are what makes a config asking for 10^9 layers, a 2^40 vocabulary or a 2^31-token context fail in
  microseconds, before anything is built or allocated.
* A model's args dataclass (engine/models/*.py) is the list of keys that architecture reads. Each field
  gets its rule from, in order: its annotation (`int` -> an integer >= 0, `float` -> a finite number,
  `bool`, `str`, `list[int]`, `X | None` -> null allowed), then `COMMON` under the same name, then the
  field's own metadata (`swiglu_limit: float = cfg(7.0, gt=0)`), each refining the one before. A new model
  file gets its fields checked by type with no code at all.
* Relations between values (heads divide, 0 < top-k <= experts, head_dim > 0, layer_types one per
  layer, at least one MoE layer, YaRN's required keys) are checked once, generically, after the args
  are built: `check_relations`. They read the architecture's answers (`num_experts`, `top_k`,
  `moe_intermediate`, `is_moe_layer`) through the properties every model file defines.

Why not pydantic (installed here only as a dependency of a test tool): its messages would need rewriting
into this one-line form anyway, it is not a dependency of moechat, and `moechat fit` must answer without
importing more than the standard library. The rules are plain data; the checker is ~100 lines.
No torch here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, ConfigError

# Caps: several times the largest published model's value, far below what would exhaust a machine.
MAX_LAYERS = 1024  # Qwen3-235B has 94 layers, DeepSeek-V3 61
MAX_VOCAB = 2**22  # 4.2M ids; the largest vocabularies are ~262k (Gemma 3)
MAX_HIDDEN = 65_536  # 16,384 is the widest (Llama-3.1-405B)
MAX_HEADS = 1024  # DeepSeek-V3 has 128
MAX_HEAD_DIM = 4096  # 256 (Gemma), 192 + 64 (DeepSeek MLA)
MAX_EXPERTS = 8192  # 512 (Qwen3-Next), 384 (Kimi K2)
MAX_INTERMEDIATE = 2**20  # 53,248 (Llama-3.1-405B)
MAX_CONTEXT = 2**24  # 16.8M positions; Llama 4 Scout declares 10M
MAX_TOKEN_ID = 2**31 - 1
MAX_INT = 2**31 - 1  # any other integer field


@dataclass(frozen=True)
class Rule:
    """What a value may be. `kind`: int, float (finite), number (any JSON number), bool, str, list, dict, any."""

    kind: str = "any"
    min: float | None = None  # inclusive bounds
    max: float | None = None
    gt: float | None = None  # exclusive lower bound
    choices: tuple = ()
    items: Rule | None = None  # every item of a list
    keys: Mapping[str, Rule] | None = None  # known keys of a dict (others pass)
    values: Rule | None = None  # every value of a dict
    any_of: tuple[Rule, ...] = ()  # the value matches one of these
    nullable: bool = False
    required: bool = False
    max_items: int | None = None

    def describe(self) -> str:
        if self.any_of:
            text = ", or ".join(r.describe() for r in self.any_of)
        elif self.choices:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text = {"int": "an integer", "float": "a finite number", "number": "a number", "bool": "true or false",
                    "str": "a string", "list": "a list", "dict": "a JSON object", "any": "any value"}[self.kind]
            lo, hi = (self.min, self.max)
            if lo is not None and hi is not None:
                text += f" in {_num(lo)}..{_num(hi)}"
            elif self.gt is not None and hi is not None:
                text += f" > {_num(self.gt)} and <= {_num(hi)}"
            elif self.gt is not None:
                text += f" > {_num(self.gt)}"
            elif lo is not None:
                text += f" >= {_num(lo)}"
            elif hi is not None:
                text += f" <= {_num(hi)}"
            if self.kind == "list" and self.items is not None:
                text += f" (each item {self.items.describe()})"
            if self.kind == "dict" and self.values is not None:
                text += f" (each value {self.values.describe()})"
        return text + (" or null" if self.nullable else "")


def _num(x: float) -> str:
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 2**53):
        n = int(x)
        return f"{n:,}" if abs(n) >= 10_000 else str(n)
    return f"{x:g}"


def _int(**kw) -> Rule:
    return Rule("int", **kw)


def _float(**kw) -> Rule:
    return Rule("float", **kw)


TOKEN_ID = _int(min=0, max=MAX_TOKEN_ID)
TOKEN_IDS = Rule(any_of=(TOKEN_ID, Rule("list", items=TOKEN_ID, max_items=4096)), nullable=True)
_POSITIVE = _float(gt=0)

# RoPE parameters (rope_scaling in transformers 4, rope_parameters in 5), by key.
ROPE_KEYS: dict[str, Rule] = {
    "rope_type": Rule("str"), "type": Rule("str"),
    "rope_theta": _POSITIVE, "factor": _POSITIVE,
    "original_max_position_embeddings": _int(min=1, max=MAX_CONTEXT),
    "beta_fast": _POSITIVE, "beta_slow": _POSITIVE, "attention_factor": _POSITIVE,
    "mscale": _float(min=0), "mscale_all_dim": _float(min=0),
    "low_freq_factor": _POSITIVE, "high_freq_factor": _POSITIVE,
    "partial_rotary_factor": _float(gt=0, max=1), "truncate": Rule("bool"),
}

# config.json keys with one meaning across model types.
COMMON: dict[str, Rule] = {
    "model_type": Rule("str"),
    "vocab_size": _int(min=1, max=MAX_VOCAB, required=True),
    "hidden_size": _int(min=1, max=MAX_HIDDEN, required=True),
    "num_hidden_layers": _int(min=1, max=MAX_LAYERS, required=True),
    "num_attention_heads": _int(min=1, max=MAX_HEADS, required=True),
    "num_key_value_heads": _int(min=1, max=MAX_HEADS, nullable=True),
    "head_dim": _int(min=1, max=MAX_HEAD_DIM, nullable=True),
    "intermediate_size": _int(min=0, max=MAX_INTERMEDIATE),
    "moe_intermediate_size": _int(min=1, max=MAX_INTERMEDIATE),
    "num_experts": _int(min=1, max=MAX_EXPERTS),
    "num_local_experts": _int(min=1, max=MAX_EXPERTS),
    "n_routed_experts": _int(min=1, max=MAX_EXPERTS),
    "num_experts_per_tok": _int(min=1, max=MAX_EXPERTS),
    "experts_per_token": _int(min=1, max=MAX_EXPERTS),
    "n_shared_experts": _int(min=0, max=MAX_EXPERTS, nullable=True),
    "n_group": _int(min=1, max=MAX_EXPERTS, nullable=True),
    "topk_group": _int(min=1, max=MAX_EXPERTS, nullable=True),
    "first_k_dense_replace": _int(min=0, max=MAX_LAYERS),
    "moe_layer_freq": _int(min=1, max=MAX_LAYERS),
    "decoder_sparse_step": _int(min=1, max=MAX_LAYERS),
    "mlp_only_layers": Rule("list", items=_int(min=0, max=MAX_LAYERS), max_items=MAX_LAYERS),
    "routed_scaling_factor": _POSITIVE,
    "kv_lora_rank": _int(min=1, max=MAX_HIDDEN, nullable=True),
    "q_lora_rank": _int(min=1, max=MAX_HIDDEN, nullable=True),
    "qk_rope_head_dim": _int(min=1, max=MAX_HEAD_DIM),
    "qk_nope_head_dim": _int(min=0, max=MAX_HEAD_DIM),
    "v_head_dim": _int(min=1, max=MAX_HEAD_DIM),
    "partial_rotary_factor": _float(gt=0, max=1),
    "rms_norm_eps": _float(gt=0, max=1),
    "max_position_embeddings": _int(min=1, max=MAX_CONTEXT),
    "rope_theta": _float(gt=0, nullable=True),
    "rope_scaling": Rule("dict", keys=ROPE_KEYS, nullable=True),
    "rope_parameters": Rule("dict", keys=ROPE_KEYS, nullable=True),
    "sliding_window": _int(min=1, max=MAX_CONTEXT, nullable=True),
    "use_sliding_window": Rule("bool"),
    "layer_types": Rule("list", items=Rule("str"), max_items=MAX_LAYERS, nullable=True),
    "bos_token_id": TOKEN_IDS,
    "eos_token_id": TOKEN_IDS,
    "pad_token_id": TOKEN_IDS,
    "tie_word_embeddings": Rule("bool"),
    "attention_bias": Rule("bool"),
    "norm_topk_prob": Rule("bool"),
    "hidden_act": Rule("str"),
    "clip_qkv": _float(gt=0, nullable=True),
    "dtype": Rule("str", nullable=True),
    "torch_dtype": Rule("str", nullable=True),
    "quantization_config": Rule("dict", nullable=True),
    "auto_map": Rule("dict", nullable=True),
    "architectures": Rule("list", items=Rule("str"), nullable=True),
}

# generation_config.json: what moechat reads from it (sampling defaults, stops, length).
GENERATION_CONFIG: dict[str, Rule] = {
    "eos_token_id": TOKEN_IDS, "bos_token_id": TOKEN_IDS, "pad_token_id": TOKEN_IDS,
    "max_new_tokens": _int(min=1, max=MAX_CONTEXT, nullable=True),
    "max_length": _int(min=1, max=MAX_CONTEXT, nullable=True),
    "do_sample": Rule("bool", nullable=True),
    "temperature": _float(min=0, nullable=True),
    "top_k": _int(min=0, max=MAX_VOCAB, nullable=True),
    "top_p": _float(min=0, max=1, nullable=True),
    "min_p": _float(min=0, max=1, nullable=True),
    "repetition_penalty": _float(gt=0, nullable=True),
}

# tokenizer_config.json: the special tokens and the chat template.
_TOKEN = Rule(any_of=(Rule("str"), Rule("dict", keys={"content": Rule("str", required=True)})), nullable=True)
_TEMPLATE = Rule(any_of=(Rule("str"), Rule("list", items=Rule("dict", keys={"name": Rule("str", required=True),
                                                                            "template": Rule("str", required=True)}))),
                 nullable=True)
TOKENIZER_CONFIG: dict[str, Rule] = {
    **{name: _TOKEN for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                 "mask_token")},
    "chat_template": _TEMPLATE,
    "add_bos_token": Rule("bool", nullable=True), "add_eos_token": Rule("bool", nullable=True),
    "additional_special_tokens": Rule("list", items=_TOKEN, nullable=True),
    "extra_special_tokens": Rule(any_of=(Rule("list", items=_TOKEN), Rule("dict", values=_TOKEN)), nullable=True),
    "added_tokens_decoder": Rule("dict", values=Rule("dict", keys={"content": Rule("str", required=True)}),
                                 nullable=True),
    "model_max_length": Rule("number", min=0, nullable=True),
}

# Weights moechat never reads (unpickling can run arbitrary code): a folder with only these is refused.
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")

# model.safetensors.index.json
INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = Rule("str")
SAFETENSORS_INDEX: dict[str, Rule] = {
    "metadata": Rule("dict", keys={"total_size": Rule("number", min=0, nullable=True)}, nullable=True),
    "weight_map": Rule("dict", values=_SHARD_NAME, required=True),
}


# -- checking ----------------------------------------------------------------------------------------------

class Violation(Exception):
    """One broken rule: key (dotted), value, what is allowed. Turned into a typed error by the caller."""

    def __init__(self, key: str, value: Any, allowed: str, missing: bool = False):
        super().__init__(key)
        self.key, self.value, self.allowed, self.missing = key, value, allowed, missing

    def line(self, where: str) -> str:
        if self.missing:
            return f"{where}: {self.key} is missing: it must be {self.allowed}"
        return f"{where}: {self.key} = {show(self.value)} is not allowed: {self.allowed}"


def show(value: Any, limit: int = 60) -> str:
    """A value as a user would type it, cut to `limit` characters."""
    try:
        text = repr(value) if not isinstance(value, (dict, list)) else _short_json(value)
    except (RecursionError, ValueError):
        text = f"<a deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short_json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, default=str)[:200]


_KINDS = {"list": list, "dict": dict, "str": str}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_value(value: Any, rule: Rule, key: str) -> Any:
    """The value, normalised (an integral float for an int is an int, an int for a float a float), or Violation."""
    if value is None:
        if rule.nullable:
            return None
        raise Violation(key, value, f"must be {rule.describe()}")
    if rule.any_of:
        same_type = []  # alternatives of the value's own JSON type: their own complaint is the precise one
        for alt in rule.any_of:
            try:
                return check_value(value, alt, key)
            except Violation as v:
                if _KINDS.get(alt.kind) and isinstance(value, _KINDS[alt.kind]) and not isinstance(value, bool):
                    same_type.append(v)
        if len(same_type) == 1:
            raise same_type[0]
        raise Violation(key, value, f"must be {rule.describe()}")
    bad = Violation(key, value, f"must be {rule.describe()}")
    kind = rule.kind
    if kind == "int":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if not _is_int(value):
            raise bad
    elif kind in ("float", "number"):
        if not (_is_int(value) or isinstance(value, float)):
            raise bad
        if kind == "float":
            try:
                value = float(value)
            except OverflowError:
                raise bad from None
            if not math.isfinite(value):
                raise bad
    elif kind == "bool":
        if not isinstance(value, bool):
            raise bad
    elif kind == "str":
        if not isinstance(value, str):
            raise bad
    elif kind == "list":
        if not isinstance(value, list):
            raise bad
        if rule.max_items is not None and len(value) > rule.max_items:
            raise Violation(key, value, f"must have at most {rule.max_items:,} items, not {len(value):,}")
        if rule.items is not None:
            value = [check_value(v, rule.items, f"{key}[{i}]") for i, v in enumerate(value)]
    elif kind == "dict":
        if not isinstance(value, dict):
            raise bad
        if rule.keys is not None:
            value = check_mapping(value, rule.keys, prefix=f"{key}.")
        if rule.values is not None:
            value = {k: check_value(v, rule.values, f"{key}.{k}") for k, v in value.items()}
    if rule.choices and value not in rule.choices:
        raise bad
    if kind in ("int", "float", "number"):
        if ((rule.min is not None and value < rule.min) or (rule.max is not None and value > rule.max)
                or (rule.gt is not None and value <= rule.gt)):
            raise bad
    return value


def check_mapping(data: Mapping, rules: Mapping[str, Rule], prefix: str = "") -> dict:
    """`data` with each key that has a rule checked (and normalised); unknown keys pass through."""
    out = dict(data)
    for name, rule in rules.items():
        if name in data:
            out[name] = check_value(data[name], rule, prefix + name)
        elif rule.required:
            raise Violation(prefix + name, None, rule.describe(), missing=True)
    return out


def check_file(data: Any, rules: Mapping[str, Rule], where: str, what: str, error=ConfigError) -> dict:
    """A whole JSON file against a table: an object, and each key it has by its rule."""
    if not isinstance(data, dict):
        raise error(f"{where}: {what} must be a JSON object, found {type(data).__name__}", path=where)
    try:
        return check_mapping(data, rules)
    except Violation as v:
        raise _error(error, v, where) from None


def _error(error, v: Violation, where: str):
    if error is CheckpointError:
        return CheckpointError(v.line(where), path=where)
    return error(v.line(where), path=where, key=v.key)


def check_generation_config(data: Any, where: str) -> dict:
    return check_file(data, GENERATION_CONFIG, where, "generation config")


def check_tokenizer_config(data: Any, where: str) -> dict:
    return check_file(data, TOKENIZER_CONFIG, where, "tokenizer config")


def check_index(data: Any, where: str) -> dict:
    """model.safetensors.index.json: a non-empty weight_map of tensor name -> shard file name in this folder."""
    index = check_file(data, SAFETENSORS_INDEX, where, "safetensors index", error=CheckpointError)
    weight_map = index["weight_map"]
    if not weight_map:
        raise CheckpointError(f"{where}: weight_map is empty: it must name each tensor's shard file", path=where)
    for name, shard in weight_map.items():
        if (not shard.endswith(".safetensors") or "/" in shard or "\\" in shard or shard.startswith(".")
                or "\x00" in shard):
            raise CheckpointError(f"{where}: weight_map.{name} = {show(shard)} is not allowed: must be the name of a "
                                  "*.safetensors file in the model folder (no directories)", path=where)
    return index


# -- config.json through a model's args dataclass -------------------------------------------------------------

RULE_KEY = "moechat_rule"


def cfg(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **rule: Any):
    """A dataclass field with its rule beside it: `swiglu_limit: float = cfg(7.0, gt=0)`. The keywords refine
    the rule from the annotation and COMMON (min, max, gt, choices, items, nullable, required...)."""
    return field(default=default, default_factory=default_factory, metadata={RULE_KEY: rule})


def _rule_from_annotation(tp: Any) -> Rule:
    nullable = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(tp))
        if len(args) != 1:
            return Rule(nullable=nullable)
        tp = args[0]
        origin = typing.get_origin(tp)
    base = origin or tp
    if base is bool:
        rule = Rule("bool")
    elif base is int:
        rule = _int(min=0, max=MAX_INT)
    elif base is float:
        rule = _float()
    elif base is str:
        rule = Rule("str")
    elif base is list:
        item = typing.get_args(tp)
        rule = Rule("list", items=_rule_from_annotation(item[0]) if item else None)
    elif base is dict:
        rule = Rule("dict")
    else:
        rule = Rule()
    return dataclasses.replace(rule, nullable=nullable) if nullable else rule


@functools.cache
def rules_for(cls: type) -> dict[str, Rule]:
    """Every dataclass field of a model's args class -> its rule (annotation, then COMMON, then metadata)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        rule = _rule_from_annotation(hints.get(f.name, Any))
        nullable = rule.nullable
        if f.name in COMMON:
            rule = COMMON[f.name]
        for klass in cls.__mro__:  # the most derived declaration that carries a rule
            own = getattr(klass, "__dataclass_fields__", {}).get(f.name)
            if own is not None and RULE_KEY in own.metadata:
                rule = dataclasses.replace(rule, **own.metadata[RULE_KEY])
                break
        if nullable and not rule.nullable:
            rule = dataclasses.replace(rule, nullable=True)
        out[f.name] = rule
    return out


def check_fields(cls: type, values: dict, where: str, names: Mapping[str, str] | None = None) -> dict:
    """The constructor keywords of a model's args class, checked against its rules. `names` maps a field to the
    key the file spells it with (an alias). A null where null is not allowed means "unset": the default."""
    names = names or {}
    out = dict(values)
    try:
        for name, rule in rules_for(cls).items():
            key = names.get(name, name)
            if name not in values:
                if rule.required:
                    raise Violation(key, None, rule.describe(), missing=True)
                continue
            if values[name] is None and not rule.nullable:
                if rule.required:
                    raise Violation(key, None, rule.describe(), missing=True)
                del out[name]
                continue
            out[name] = check_value(values[name], rule, key)
    except Violation as v:
        raise _error(ConfigError, v, where) from None
    return out


def check_explicit(obj: Any, where: str = "config.json") -> None:
    """A dataclass built in code (not from a file): the fields given a value other than their default, and the
    required ones, by their rules. (from_dict has checked a file's values already, with the file's path.)"""
    values = {}
    rules = rules_for(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if rules[f.name].required or value is not default and value != default:
            values[f.name] = value
    check_fields(type(obj), values, where)


def check_common(raw: dict, where: str, skip: frozenset[str] | set[str] = frozenset()) -> None:
    """The keys of `COMMON` a config.json has (but `skip`): types, ranges and caps, before anything is built."""
    try:
        for name, rule in COMMON.items():
            if name in raw and name not in skip and not (raw[name] is None and not rule.nullable):
                check_value(raw[name], rule, name)
    except Violation as v:
        raise _error(ConfigError, v, where) from None


# Which key holds a concept in a given family (the first one that is a field of the args class).
_CONCEPT_KEYS = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k"),
    "moe_intermediate": ("moe_intermediate_size", "intermediate_size", "expert_intermediate_size"),
}


def _key_of(args: Any, concept: str) -> str:
    names = {f.name for f in dataclasses.fields(args)}
    return next((k for k in _CONCEPT_KEYS[concept] if k in names), concept)


def check_relations(args: Any, where: str, raw: Mapping | None = None) -> None:
    """Rules between values, after the args are built (defaults filled, aliases resolved). Generic: every
    architecture answers num_experts, top_k, moe_intermediate and is_moe_layer. With `raw` (the file's dict),
    a value that only has its default because the file lacks the key is reported as missing."""
    def fail(key: str, value: Any, allowed: str, defaulted: bool = False):
        missing = defaulted and raw is not None and raw.get(key) is None
        v = Violation(key, value, allowed.removeprefix("must be "), True) if missing else Violation(key, value, allowed)
        raise ConfigError(v.line(where), path=where, key=key)

    nH, nKV = args.num_attention_heads, args.num_key_value_heads
    if not _is_int(nKV) or nKV < 1 or nKV > nH or nH % nKV:
        fail("num_key_value_heads", nKV, f"must divide num_attention_heads ({nH}) evenly")
    if not _is_int(args.head_dim) or args.head_dim < 1:
        fail("head_dim", args.head_dim, f"must be >= 1 (hidden_size {args.hidden_size} / num_attention_heads {nH} "
             "when head_dim is not given)")
    E, K, I = args.num_experts, args.top_k, args.moe_intermediate
    if not _is_int(E) or not 1 <= E <= MAX_EXPERTS:
        fail(_key_of(args, "num_experts"), E, f"must be an integer in 1..{MAX_EXPERTS:,} (the number of experts)",
             True)
    if not _is_int(K) or not 0 < K <= E:
        fail(_key_of(args, "top_k"), K, f"must be an integer in 1..{E} (top-k, at most the {E} experts)", True)
    if not _is_int(I) or not 1 <= I <= MAX_INTERMEDIATE:
        fail(_key_of(args, "moe_intermediate"), I, f"must be an integer in 1..{MAX_INTERMEDIATE:,} (the expert size)",
             True)
    rope = getattr(args, "rope", None) or {}
    theta = rope.get("rope_theta")
    if not (isinstance(theta, (int, float)) and not isinstance(theta, bool) and math.isfinite(theta) and theta > 0):
        fail("rope_theta", theta, "must be a finite number > 0")
    if rope.get("rope_type") == "yarn":
        spelled = "rope_parameters" if getattr(args, "rope_parameters", None) else "rope_scaling"
        for key in ("factor", "original_max_position_embeddings"):
            if rope.get(key) is None:
                v = Violation(f"{spelled}.{key}", None, f"{ROPE_KEYS[key].describe()} (YaRN RoPE needs it)", True)
                raise ConfigError(v.line(where), path=where, key=v.key)
    L = args.num_hidden_layers
    layer_types = getattr(args, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) != L:
        fail("layer_types", layer_types, f"must have one entry per layer ({L}), not {len(layer_types)}")
    moe = [i for i in range(L) if args.is_moe_layer(i)]
    if not moe:
        fail("num_hidden_layers", L, "no layer is a Mixture-of-Experts layer with these settings (check "
             "decoder_sparse_step, mlp_only_layers, first_k_dense_replace); moechat runs MoE models")
    dense_inter = getattr(args, "intermediate_size", None)
    if len(moe) < L and dense_inter is not None and (not _is_int(dense_inter) or dense_inter < 1):
        fail("intermediate_size", dense_inter, f"must be >= 1: layers {[i for i in range(L) if i not in moe][:8]} "
             "are dense MLPs of this size")


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def check_layers(num_layers: int, tensor_names: Iterable[str], where: str) -> None:
    """num_hidden_layers against the layers the checkpoint holds (`model.layers.N.*`), before any model is built.
    More layers in the checkpoint is allowed (DeepSeek-V3 and GLM-4.5 ship a multi-token-prediction layer past
    the last); a layer the config counts and the checkpoint lacks is not."""
    present = set()
    for name in tensor_names:
        m = _LAYER_NAME.match(name)
        if m:
            present.add(int(m.group(1)))
    if not present:
        return  # another naming: the per-tensor checks name what is missing
    missing = [i for i in range(num_layers) if i not in present]
    if missing:
        raise ConfigError(f"{where}: num_hidden_layers = {num_layers} is not allowed: the checkpoint has tensors for "
                          f"{len(present)} layers (model.layers.{min(present)}..{max(present)}) and none for layer "
                          f"{missing[0]}; config.json and the weights disagree", path=where, key="num_hidden_layers")
