"""The tuning panel: expert slots, the RAM tier's size, the eviction policy and prefetch, changed live; and the
expert format (native, int8, int4), which takes a reload.

Textual has no slider, so each knob is an integer `Input` that steps like one: Up/Down by a sixteenth of
the range, +/- by one; Enter applies it (and focus goes back to the prompt), so does leaving it with Tab.
Escape leaves it without applying: the knob shows the engine's value again, and the screen's Escape (back to
the prompt, or Stop while a reply streams) runs as anywhere else.
The policy and the cross-layer prefetch mode are `Select`s (Enter opens, arrows pick, Enter applies). F6
in the chat focuses the first knob. A change is posted as `TuningPanel.Changed`; the bridge applies it
between two tokens, and the line under the knobs shows the *effective* configuration the engine reports
back, not what was typed.

Under the slots knob, the hit rate predicted at the slot count shown, for a warm cache (each expert's first
use left out): LRU's from a `HitCurve` (one stack-distance pass over the routing seen so far, computed by
the bridge off the UI thread; see engine/cache/mrc.py), read off at once as the knob moves; and the
chosen policy's, replayed through the real policy class at that slot count (engine/cache/replay.py, a
bridge worker asked a quarter second after the knob or the policy settles: `PredictionWanted`). Hidden
until a curve has arrived.

Against a remote server (`moechat chat --remote`) the knobs are hidden and one line says why: its cache is
tuned where it runs (`show_unavailable`).

On a CPU that computes every miss in place (on-miss auto or host: `CacheState.fast_tier` "ram") no miss ever
fills a slot, so the slots knob is not shown: the RAM tier over the disk is the cache there, and the prediction
moves under the RAM knob, read at the number of experts that many MiB hold (the share of requests served
without a disk read).

The format `Select` posts `TuningPanel.FormatChosen`: the chat screen confirms it (the first start in a
converted format writes a repacked file as big as the experts in that format, shown beside the knob) and
reloads the model through the bridge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual import on
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.validation import Integer
from textual.widgets import Input, Label, Select

from ..livestats import fmt_bytes
from ..messages import CacheState, ModelInfo
from .text import FitLabel, plural

if TYPE_CHECKING:
    from moechat.engine.cache.mrc import HitCurve


class StepInput(Input):
    """An integer input that steps like a slider within [minimum, maximum]: Up/Down by a sixteenth of the
    range, + and - by one. Stepping only moves the value (the prediction follows); Enter applies it, Escape
    puts back `applied` (the engine's value) and lets the screen's Escape run."""

    def __init__(self, *args, minimum: int = 0, maximum: int = 1 << 40, **kwargs):
        super().__init__(*args, type="integer", compact=True, **kwargs)
        self.minimum, self.maximum = minimum, maximum
        self.applied = ""  # the value the engine runs with ("" for the RAM knob: every expert in RAM)

    def revert(self) -> None:
        """Back to the engine's value: leaving the knob then posts nothing."""
        if self.value != self.applied:
            self.value = self.applied
            self.cursor_position = len(self.value)

    def step(self, direction: int, fine: bool = False) -> None:
        try:
            value = int(self.value or self.placeholder or 0)
        except ValueError:
            value = self.minimum
        delta = 1 if fine else max((self.maximum - self.minimum) // 16, 1)
        self.value = str(min(max(value + direction * delta, self.minimum), self.maximum))
        self.cursor_position = len(self.value)

    def key_up(self) -> None:
        self.step(+1)

    def key_down(self) -> None:
        self.step(-1)

    async def _on_key(self, event) -> None:
        if event.key == "escape":  # not a binding: the footer keeps the screen's Escape (Prompt / Stop), which
            self.revert()  # runs as the key goes on up to the app's bindings
        elif event.character in ("+", "-", "=", "_"):  # = and _: the same keys unshifted / shifted
            event.stop()
            event.prevent_default()
            self.step(+1 if event.character in "+=" else -1, fine=True)
            return
        await super()._on_key(event)


def describe_state(state: CacheState | None) -> str:
    if state is None:
        return "now: every expert resident (no cache)"
    if state.fast_tier == "ram":  # a CPU computing misses in place: the RAM tier over the disk is the cache
        fetch = f" · prefetch {state.prefetch} (disk -> RAM)" if state.prefetch != "off" else ""
        if not state.ram_budget_bytes:
            return f"now: every expert in RAM, none read from disk · {state.policy}{fetch}"
        return (f"now: RAM tier {fmt_bytes(state.ram_used_bytes)}/{fmt_bytes(state.ram_budget_bytes)} "
                f"({state.ram_tier_experts:,} of {state.max_slots:,} experts) · {state.policy}{fetch}")
    pct = f" ({state.slots / state.max_slots:.0%})" if state.max_slots else ""
    if state.ram_budget_bytes:
        ram = f"RAM tier {fmt_bytes(state.ram_used_bytes)}/{fmt_bytes(state.ram_budget_bytes)}"
    else:
        ram = "all in RAM"
    fetch = f" · prefetch {state.prefetch}" if state.prefetch != "off" else ""
    return f"now: {state.slots}/{state.max_slots} slots{pct} · {state.policy} · {ram}{fetch}"


def lru_warm_rate(curve: HitCurve, slots: int) -> float | None:
    """LRU's hit rate at `slots` once the cache is warm: each key's first use (a miss at any size) left out.

    Past the curve's end every key fits, so hits there are every request but the first uses."""
    warm = int(curve.hits[-1])
    return curve.hits_at(slots) / warm if warm else None


def describe_prediction(curve: HitCurve, slots: int | None, policy: str | None = None,
                        policy_rate: float | None = None, on_miss: str = "load") -> str:
    """'predicted ~42% at 24 slots (lrfu-layered)', then LRU's rate beside it and where the routing comes from.

    `policy_rate`: the chosen policy replayed at `slots` (None while it is being replayed). The replay loads every
    miss into a slot; with `on_miss` auto or host some misses run on the host and stay misses (the demo at 24
    slots: 85% measured with load, 41% with auto), which the last line says."""
    what = "decode, warm cache" if curve.phase == "decode" else "warm cache"
    where = f"  on {curve.source or 'recorded routing'}, {plural(curve.tokens, 'token')}"
    if on_miss != "load":
        where += f"\n  if each miss loads a slot; on-miss {on_miss} runs some on the host: fewer hits, not slower"
    if slots is None or slots < 1:
        return f"predicted –\n{where}"
    lru = lru_warm_rate(curve, slots)
    lru_text = "–" if lru is None else f"{lru:.0%}"
    at = plural(slots, "slot")
    if policy in (None, "", "lru"):
        return f"predicted ~{lru_text} at {at} (lru)\n  {what}\n{where}"
    head = (f"predicted {policy} at {at}: replaying…" if policy_rate is None
            else f"predicted ~{policy_rate:.0%} at {at} ({policy})")
    return f"{head}\n  LRU ~{lru_text} · {what}\n{where}"


def describe_ram_prediction(curve: HitCurve, experts: int | None, total: int, policy: str | None = None,
                            policy_rate: float | None = None) -> str:
    """Under the RAM knob on a CPU: the share of requests served from RAM (no disk read) predicted for a RAM tier
    of `experts` experts (None: the knob is empty, every expert in RAM), warm cache."""
    where = f"  on {curve.source or 'recorded routing'}, {plural(curve.tokens, 'token')}"
    if experts is None or experts >= total:
        return f"predicted 100% from RAM (every expert in RAM: nothing read from disk)\n{where}"
    if experts < 1:
        return f"predicted 0% from RAM (a RAM tier under one expert: every request reads the disk)\n{where}"
    lru = lru_warm_rate(curve, experts)
    lru_text = "–" if lru is None else f"{lru:.0%}"
    held = f"{experts:,} of {total:,} experts"
    if policy in (None, "", "lru"):
        return f"predicted ~{lru_text} from RAM ({held}, lru)\n  warm cache, the rest from disk\n{where}"
    head = (f"predicted {policy} with {held}: replaying…" if policy_rate is None
            else f"predicted ~{policy_rate:.0%} from RAM ({held}, {policy})")
    return f"{head}\n  LRU ~{lru_text} · warm cache, the rest from disk\n{where}"


EXPERT_FORMATS = ("native", "int8", "int4")
NATIVE_NAMES = {"dense": "", "mxfp4": "MXFP4", "fp8": "FP8"}  # dense: the compute dtype says it


def describe_format(info: ModelInfo | None, fmt: str) -> str:
    """Beside the format knob: all the experts' size in that format (for native, MXFP4 or FP8 named too)."""
    if info is None:
        return ""
    size = info.format_bytes.get(fmt)
    what = NATIVE_NAMES.get(info.native_format, info.native_format) if fmt == "native" else ""  # bf16: the header
    return " · ".join(x for x in (what, fmt_bytes(size) if size else "") if x)



class TuningPanel(Vertical):
    @dataclass
    class Changed(Message):
        expert_slots: int | None = None
        policy: str | None = None
        ram_cache_bytes: int | None = None  # 0: every expert in RAM
        prefetch: str | None = None
        done: bool = True  # applied with Enter or a pick (focus goes back to the prompt); False: left with Tab

    @dataclass
    class PredictionWanted(Message):
        """Replay `policy` at `slots` over the recorded routing (the screen asks the bridge)."""

        policy: str
        slots: int

    @dataclass
    class FormatChosen(Message):
        """The user picked another expert format: a reload, which the screen confirms first."""

        expert_format: str  # native | int8 | int4

    def __init__(self, policies: tuple[str, ...], prefetch_modes: tuple[str, ...] = (), **kwargs):
        super().__init__(**kwargs)
        self.policies = policies
        self.prefetch_modes = prefetch_modes
        self.state: CacheState | None = None
        self.curve: HitCurve | None = None
        self.info: ModelInfo | None = None  # the loaded model: its expert format and sizes
        self._sent: dict[str, int] = {}  # knob id -> the value last posted (a blur after Enter does not repeat it)
        self.replayed: dict[tuple[str, int], float | None] = {}  # (policy, slots) -> warm rate, this curve
        self.on_miss = "load"  # where the engine runs a miss (the prediction assumes load)
        self.unavailable: str | None = None  # why no knob can act here (a remote server), when so
        self._predict_timer = None

    def compose(self):
        yield Label("↑↓ step · +/- by 1 · Enter apply · Tab next", id="tuning-keys", classes="hint", markup=False)
        with Horizontal(classes="knob", id="slots-knob"):
            yield Label("slots", classes="knob-label")
            yield StepInput(id="slots", minimum=1, validators=[Integer(minimum=1)], valid_empty=False)
            yield FitLabel("", id="slots-of", classes="knob-note")
        yield Label("", id="predicted", markup=False)
        with Horizontal(classes="knob"):
            yield Label("RAM MiB", classes="knob-label")
            yield StepInput(id="ram-mb", minimum=0, placeholder="all", validators=[Integer(minimum=0)],
                            valid_empty=True)
            yield FitLabel("", id="ram-of", classes="knob-note")
        yield Label("", id="ram-predicted", markup=False)
        with Horizontal(classes="knob"):
            yield Label("policy", classes="knob-label")
            yield Select([(p, p) for p in self.policies], id="policy", allow_blank=True, compact=True,
                         prompt="–")
        if self.prefetch_modes:
            with Horizontal(classes="knob"):
                yield Label("fetch", classes="knob-label")
                yield Select([(m, m) for m in self.prefetch_modes], id="prefetch", allow_blank=True, compact=True,
                             prompt="–")
        with Horizontal(classes="knob"):
            yield Label("format", classes="knob-label")
            yield Select([(f, f) for f in EXPERT_FORMATS], id="format", allow_blank=True, compact=True, prompt="–")
            yield FitLabel("", id="format-of", classes="knob-note")
        yield Label("now: waiting for the model…", id="effective")
        yield Label("", id="tuning-off", markup=False)

    def on_mount(self) -> None:
        self.disabled = True  # until a model with a cache is loaded
        self.query_one("#predicted", Label).display = False
        self.query_one("#ram-predicted", Label).display = False
        self.query_one("#tuning-off", Label).display = False

    def show_unavailable(self, reason: str) -> None:
        """No knob can act here (a remote server tunes its own cache): every knob hidden, `reason` in one line."""
        self.unavailable = reason
        for child in self.children:
            child.display = child.id in ("tuning-off", "effective")  # and what the server runs with
        off = self.query_one("#tuning-off", Label)
        off.update(reason)
        off.display = True
        self.disabled = True

    @property
    def ram_tier(self) -> bool:
        """A CPU computing misses in place: the slots change nothing, so the RAM knob carries the prediction."""
        return self.state is not None and self.state.fast_tier == "ram"

    def knob_ram_experts(self) -> int | None:
        """The RAM knob as a number of experts (None: empty, every expert in RAM)."""
        value = self.query_one("#ram-mb", StepInput).value
        if not value or self.state is None or not self.state.expert_bytes:
            return None
        try:
            return (int(value) << 20) // self.state.expert_bytes
        except ValueError:
            return None

    def _capacity(self) -> int | None:
        """What the prediction is asked at: slots, or the RAM tier's experts on a CPU."""
        if not self.ram_tier:
            return self.knob_slots()
        experts = self.knob_ram_experts()
        return None if experts is None or experts >= self.state.max_slots else experts

    def show_curve(self, curve: HitCurve) -> None:
        """A new hit-rate curve (new routing): predict at the slot count the knob shows now."""
        self.curve = curve
        self.replayed = {}
        self._show_prediction()

    def show_on_miss(self, on_miss: str) -> None:
        """Where the engine runs misses (from the stats): the prediction says what it assumes when not "load"."""
        if on_miss != self.on_miss:
            self.on_miss = on_miss
            self._show_prediction(ask=False)

    def show_replay(self, policy: str, slots: int, warm_rate: float | None) -> None:
        """The bridge's replay of `policy` at `slots` (engine/cache/replay.py)."""
        self.replayed[(policy, slots)] = warm_rate
        self._show_prediction(ask=False)

    def knob_policy(self) -> str | None:
        value = self.query_one("#policy", Select).value
        return str(value) if isinstance(value, str) else (self.state.policy if self.state else None)

    def knob_slots(self) -> int | None:
        try:
            return int(self.query_one("#slots", StepInput).value)
        except ValueError:
            return None

    def _show_prediction(self, ask: bool = True) -> None:
        label = self.query_one("#ram-predicted" if self.ram_tier else "#predicted", Label)
        if self.curve is None:
            return
        slots, policy = self._capacity(), self.knob_policy()
        replayed = self.replayed.get((policy, slots)) if policy and slots else None
        if self.ram_tier:
            experts = self.knob_ram_experts()
            label.update(describe_ram_prediction(self.curve, experts, self.state.max_slots, policy,
                                                 replayed if experts is not None else None))
        else:
            label.update(describe_prediction(self.curve, slots, policy, replayed, self.on_miss))
        label.display = True
        if ask and policy and policy != "lru" and slots and slots >= 1 and (policy, slots) not in self.replayed:
            if self._predict_timer is not None:
                self._predict_timer.stop()
            self._predict_timer = self.set_timer(0.25, self._ask_prediction)

    def _ask_prediction(self) -> None:
        self._predict_timer = None
        slots, policy = self._capacity(), self.knob_policy()
        if policy and slots and slots >= 1 and (policy, slots) not in self.replayed:
            self.post_message(self.PredictionWanted(policy, slots))

    @on(Input.Changed, "#slots, #ram-mb")
    def _slots_moved(self, event: Input.Changed) -> None:
        event.stop()
        self._show_prediction()

    def show_state(self, state: CacheState | None, at_token: int | None = None) -> None:
        """Show what the engine runs with (after load or a retune: `at_token`, the reply's token it applied at);
        does not post Changed."""
        self.state = state
        applied = "" if at_token is None else f" (applied at token {at_token})"
        self.query_one("#effective", Label).update(describe_state(state) + applied)
        if self.unavailable is not None:  # a remote server: the knobs stay hidden
            return
        self.disabled = False
        slots = self.query_one("#slots", StepInput)
        ram = self.query_one("#ram-mb", StepInput)
        policy = self.query_one("#policy", Select)
        ram_tier = state is not None and state.fast_tier == "ram"
        self.query_one("#slots-knob").display = not ram_tier  # on a CPU computing misses in place: no effect
        self.query_one("#predicted", Label).display = not ram_tier and self.curve is not None
        self.query_one("#ram-predicted", Label).display = ram_tier and self.curve is not None
        if state is None:
            slots.value = slots.applied = ""
            return
        slots.maximum = state.max_slots
        slots.value = slots.applied = str(state.slots)
        self._show_prediction()
        self.query_one("#slots-of", Label).update(f"of {state.max_slots:,}")
        if state.all_experts_bytes:
            ram.maximum = -(-state.all_experts_bytes // (1 << 20))
            self.query_one("#ram-of", FitLabel).set_texts(f"of {ram.maximum:,} MiB (empty: all)",
                                                          f"of {ram.maximum:,} MiB")
        ram.value = ram.applied = str(state.ram_budget_bytes >> 20) if state.ram_budget_bytes else ""
        with policy.prevent(Select.Changed):
            policy.value = state.policy if state.policy in self.policies else Select.BLANK
        self._show_prediction()
        for prefetch in self.query("#prefetch").results(Select):
            with prefetch.prevent(Select.Changed):
                prefetch.value = state.prefetch if state.prefetch in self.prefetch_modes else Select.BLANK

    def show_format(self, info: ModelInfo | None) -> None:
        """The loaded model's expert format on the knob, with the formats it can take (does not post)."""
        self.info = info
        select = self.query_one("#format", Select)
        if info is None:
            return
        names = [f for f in EXPERT_FORMATS if f == "native" or f in info.format_bytes] if info.format_bytes else \
            list(EXPERT_FORMATS)
        with select.prevent(Select.Changed):
            select.set_options([(f, f) for f in names])
            select.value = info.expert_format if info.expert_format in names else Select.BLANK
        self.query_one("#format-of", Label).update(describe_format(info, info.expert_format))

    def reset_format(self) -> None:
        """Back to the format the model is loaded in (a change that was not confirmed)."""
        self.show_format(self.info)

    @on(Select.Changed, "#format")
    def _format(self, event: Select.Changed) -> None:
        event.stop()
        if event.value is Select.BLANK or self.info is None:
            return
        self.query_one("#format-of", Label).update(describe_format(self.info, str(event.value)))
        if event.value != self.info.expert_format:
            self.post_message(self.FormatChosen(str(event.value)))

    def _apply(self, knob: StepInput, done: bool) -> None:
        """Post the knob's value as a change (Enter: done, focus back to the prompt; Tab away: not done)."""
        result = knob.validate(knob.value)
        name = "slots" if knob.id == "slots" else "RAM MiB"
        if result is not None and not result.is_valid:
            if done:
                self.notify(f"{name}: {'; '.join(result.failure_descriptions)}", severity="warning")
            return
        if knob.id == "slots":
            value = int(knob.value)
            change = {"expert_slots": value} if self.state is None or value != self.state.slots else {}
        else:
            value = (int(knob.value) if knob.value else 0) << 20
            change = {"ram_cache_bytes": value} if self.state is None or value != self.state.ram_budget_bytes else {}
        if change and self._sent.get(knob.id) == value and not done:
            return  # Enter sent it and focus left the knob: not twice
        if change:
            self._sent[knob.id] = value
        if change or done:  # unchanged with Enter: still back to the prompt
            self.post_message(self.Changed(**change, done=done))

    @on(Input.Submitted, "#slots, #ram-mb")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._apply(event.input, done=True)

    @on(Select.Changed, "#policy")
    def _policy(self, event: Select.Changed) -> None:
        event.stop()
        self._show_prediction()
        if event.value is not Select.BLANK and (self.state is None or event.value != self.state.policy):
            self.post_message(self.Changed(policy=str(event.value)))

    @on(Select.Changed, "#prefetch")
    def _prefetch(self, event: Select.Changed) -> None:
        event.stop()
        if event.value is not Select.BLANK and (self.state is None or event.value != self.state.prefetch):
            self.post_message(self.Changed(prefetch=str(event.value)))

    @on(Input.Blurred)
    def _blurred(self, event: Input.Blurred) -> None:
        if event.input.id in ("slots", "ram-mb") and isinstance(event.input, StepInput):
            self._apply(event.input, done=False)
