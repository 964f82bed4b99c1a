"""The tuning panel: expert slots, the RAM tier's size, the eviction policy and prefetch, changed live; and the
expert format (native, int8, int4), which takes a reload.

Textual has no slider, so each knob is an integer `Input` (Enter or leaving the field applies it;
Up/Down step it by a sixteenth of the range, like a slider's arrow keys); the policy and the cross-layer
prefetch mode are `Select`s.
A change is posted as `TuningPanel.Changed`; the bridge applies it between two tokens, and the line
under the knobs shows the *effective* configuration the engine reports back, not what was typed.

Under the slots knob, the hit rate LRU would reach at the slot count shown, read off a `HitCurve` (one
stack-distance pass over the routing seen so far, computed by the bridge off the UI thread; see
engine/cache/mrc.py): it follows the knob as it is stepped or typed, before anything is applied, so
the knob can be set by the curve. Hidden until a curve has arrived.

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

if TYPE_CHECKING:
    from moechat.engine.cache.mrc import HitCurve


class StepInput(Input):
    """An integer input whose Up/Down keys step the value within [minimum, maximum]."""

    def __init__(self, *args, minimum: int = 0, maximum: int = 1 << 40, **kwargs):
        super().__init__(*args, type="integer", compact=True, **kwargs)
        self.minimum, self.maximum = minimum, maximum

    def step(self, direction: int) -> None:
        try:
            value = int(self.value or self.placeholder or 0)
        except ValueError:
            value = self.minimum
        delta = max((self.maximum - self.minimum) // 16, 1)
        self.value = str(min(max(value + direction * delta, self.minimum), self.maximum))
        self.post_message(Input.Submitted(self, self.value))

    def key_up(self) -> None:
        self.step(+1)

    def key_down(self) -> None:
        self.step(-1)


def describe_state(state: CacheState | None) -> str:
    if state is None:
        return "now: every expert resident (no cache)"
    pct = f" ({state.slots / state.max_slots:.0%})" if state.max_slots else ""
    if state.ram_budget_bytes:
        ram = f"RAM tier {fmt_bytes(state.ram_used_bytes)}/{fmt_bytes(state.ram_budget_bytes)}"
    else:
        ram = "all in RAM"
    fetch = f" · prefetch {state.prefetch}" if state.prefetch != "off" else ""
    return f"now: {state.slots}/{state.max_slots} slots{pct} · {state.policy} · {ram}{fetch}"


def describe_prediction(curve: HitCurve, slots: int | None) -> str:
    """'predicted decode hit ~87% at 24 slots' and, on a second line, where the curve comes from."""
    what = "decode hit" if curve.phase == "decode" else "hit"
    rate = curve.hit_rate(slots) if slots is not None and slots >= 1 else None
    head = f"predicted {what} –" if rate is None else f"predicted {what} ~{rate:.0%} at {slots} slots"
    return f"{head}\n  ({curve.policy.upper()} on {curve.source or 'recorded routing'}, {curve.tokens:,} tokens)"


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

    def compose(self):
        with Horizontal(classes="knob"):
            yield Label("slots", classes="knob-label")
            yield StepInput(id="slots", minimum=1, validators=[Integer(minimum=1)], valid_empty=False)
            yield Label("", id="slots-of", classes="knob-note")
        yield Label("", id="predicted", markup=False)
        with Horizontal(classes="knob"):
            yield Label("RAM MB", classes="knob-label")
            yield StepInput(id="ram-mb", minimum=0, placeholder="all", validators=[Integer(minimum=0)],
                            valid_empty=True)
            yield Label("", id="ram-of", classes="knob-note")
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
            yield Label("", id="format-of", classes="knob-note", markup=False)
        yield Label("now: waiting for the model…", id="effective")

    def on_mount(self) -> None:
        self.disabled = True  # until a model with a cache is loaded
        self.query_one("#predicted", Label).display = False

    def show_curve(self, curve: HitCurve) -> None:
        """A new hit-rate curve: predict at the slot count the knob shows now."""
        self.curve = curve
        self._show_prediction()

    def _show_prediction(self) -> None:
        label = self.query_one("#predicted", Label)
        if self.curve is None:
            return
        try:
            slots = int(self.query_one("#slots", StepInput).value)
        except ValueError:
            slots = None
        label.update(describe_prediction(self.curve, slots))
        label.display = True

    @on(Input.Changed, "#slots")
    def _slots_moved(self, event: Input.Changed) -> None:
        event.stop()
        self._show_prediction()

    def show_state(self, state: CacheState | None) -> None:
        """Show what the engine runs with (after load or a retune); does not post Changed."""
        self.state = state
        self.query_one("#effective", Label).update(describe_state(state))
        self.disabled = False
        slots = self.query_one("#slots", StepInput)
        ram = self.query_one("#ram-mb", StepInput)
        policy = self.query_one("#policy", Select)
        if state is None:
            slots.value = ""
            return
        slots.maximum = state.max_slots
        slots.value = str(state.slots)
        self._show_prediction()
        self.query_one("#slots-of", Label).update(f"of {state.max_slots}")
        if state.all_experts_bytes:
            ram.maximum = -(-state.all_experts_bytes // (1 << 20))
            self.query_one("#ram-of", Label).update(f"of {ram.maximum} (empty: all)")
        ram.value = str(state.ram_budget_bytes >> 20) if state.ram_budget_bytes else ""
        with policy.prevent(Select.Changed):
            policy.value = state.policy if state.policy in self.policies else Select.BLANK
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

    @on(Input.Submitted, "#slots")
    def _slots(self, event: Input.Submitted) -> None:
        event.stop()
        if event.validation_result is not None and not event.validation_result.is_valid:
            self.notify(f"slots: {'; '.join(event.validation_result.failure_descriptions)}", severity="warning")
            return
        value = int(event.value)
        if self.state is None or value != self.state.slots:
            self.post_message(self.Changed(expert_slots=value))

    @on(Input.Submitted, "#ram-mb")
    def _ram(self, event: Input.Submitted) -> None:
        event.stop()
        if event.validation_result is not None and not event.validation_result.is_valid:
            self.notify(f"RAM MB: {'; '.join(event.validation_result.failure_descriptions)}", severity="warning")
            return
        mb = int(event.value) if event.value else 0
        if self.state is None or mb << 20 != self.state.ram_budget_bytes:
            self.post_message(self.Changed(ram_cache_bytes=mb << 20))

    @on(Select.Changed, "#policy")
    def _policy(self, event: Select.Changed) -> None:
        event.stop()
        if event.value is not Select.BLANK and (self.state is None or event.value != self.state.policy):
            self.post_message(self.Changed(policy=str(event.value)))

    @on(Select.Changed, "#prefetch")
    def _prefetch(self, event: Select.Changed) -> None:
        event.stop()
        if event.value is not Select.BLANK and (self.state is None or event.value != self.state.prefetch):
            self.post_message(self.Changed(prefetch=str(event.value)))

    @on(Input.Blurred)
    def _blurred(self, event: Input.Blurred) -> None:
        if event.input.id in ("slots", "ram-mb") and event.input.is_valid:
            event.input.post_message(Input.Submitted(event.input, event.input.value,
                                                     event.input.validate(event.input.value)))
