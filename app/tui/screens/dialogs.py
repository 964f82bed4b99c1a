"""Modal dialogs: the system prompt, the sampling parameters, opening another model, and changing the expert
format (a reload)."""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, TextArea

from moechat.engine.text.reasoning import REASONING_EFFORTS  # pure Python, no torch

from ..settings import SAMPLING_KEYS

CANCEL = [Binding("escape", "cancel", "Cancel")]


class SystemPromptScreen(ModalScreen[str | None]):
    BINDINGS = [*CANCEL, Binding("ctrl+s", "save", "Save")]

    def __init__(self, text: str):
        super().__init__(classes="dialog-screen")
        self.text = text

    def compose(self):
        with Vertical(classes="dialog") as box:
            box.border_title = "System prompt"
            yield Label("Sent before the conversation; applies from the next reply. Empty: none.", classes="hint")
            yield TextArea(self.text, id="system-text", soft_wrap=True)
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        self.dismiss(self.query_one("#system-text", TextArea).text.strip())

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


def _fmt_default(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class SamplingChoice:
    sampling: dict  # overrides of the model's defaults
    max_tokens: int | None
    reasoning_effort: str | None = None  # None: the chat template's default
    thinking: bool | None = None  # None: the chat template's default


class SamplingScreen(ModalScreen[SamplingChoice | None]):
    """Overrides of the model's defaults; an empty field means "the model's default", shown beside it.

    For a model whose chat template reads `reasoning_effort` (gpt-oss), a row picks it; for one with a thinking
    switch (enable_thinking: Qwen, GLM, Nemotron 3, Gemma 4), a row turns thinking on or off. Ctrl+S, or Enter in
    a field, saves.
    """

    BINDINGS = [*CANCEL, Binding("ctrl+s", "save", "Save")]

    def __init__(self, defaults: dict, generation_config: dict, overrides: dict, max_tokens: int | None,
                 default_max_tokens: int, *, reasoning_effort: str | None = None, reads_reasoning_effort: bool = False,
                 thinking: bool | None = None, thinking_switch: bool = False):
        super().__init__(classes="dialog-screen")
        self.defaults = defaults
        self.generation_config = generation_config
        self.overrides = overrides
        self.max_tokens = max_tokens
        self.default_max_tokens = default_max_tokens
        self.reasoning_effort = reasoning_effort
        self.reads_reasoning_effort = reads_reasoning_effort
        self.thinking, self.thinking_switch = thinking, thinking_switch

    def _source(self, key: str) -> str:
        return "generation_config.json" if key in self.generation_config else "built-in default"

    def compose(self):
        with Vertical(classes="dialog sampling") as box:
            box.border_title = "Sampling"
            yield Label("An empty field uses the model's default, shown on the right. Temperature 0 = greedy. "
                        "Enter or Ctrl+S saves, Escape cancels.", classes="hint")
            with Grid(id="sampling-grid"):
                yield Label("")
                yield Label("yours", classes="column-title")
                yield Label("model default", classes="column-title")
                for key in (*SAMPLING_KEYS, "max_tokens"):
                    yield Label(key.replace("_", " "), classes="param")
                    value = self.max_tokens if key == "max_tokens" else self.overrides.get(key)
                    default = self.default_max_tokens if key == "max_tokens" else self.defaults.get(key)
                    kind = "integer" if key in ("top_k", "seed", "max_tokens") else "number"
                    yield Input("" if value is None else str(value), placeholder=_fmt_default(default), type=kind,
                                id=f"param-{key}", compact=True)
                    source = self._source("max_new_tokens" if key == "max_tokens" else key)
                    yield Label(f"{_fmt_default(default)}  ({source})", classes="param-default", markup=False)
                if self.reads_reasoning_effort:
                    yield Label("reasoning effort", classes="param")
                    yield Select([(e, e) for e in REASONING_EFFORTS], id="param-reasoning_effort", prompt="–",
                                 allow_blank=True, compact=True,
                                 value=self.reasoning_effort if self.reasoning_effort else Select.NULL)
                    yield Label("the chat template's  (gpt-oss: medium)", classes="param-default", markup=False)
                if self.thinking_switch:
                    yield Label("thinking", classes="param")
                    yield Select([("on", "on"), ("off", "off")], id="param-thinking", prompt="–", allow_blank=True,
                                 compact=True,
                                 value=Select.NULL if self.thinking is None else ("on" if self.thinking else "off"))
                    yield Label("the chat template's  (Qwen: on, Gemma 4: off)", classes="param-default",
                                markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Model defaults", id="reset")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted)
    def _enter(self, event: Input.Submitted) -> None:
        event.stop()
        self.save()

    def action_save(self) -> None:
        self.save()

    @on(Button.Pressed, "#save")
    def save(self) -> None:
        overrides: dict = {}
        max_tokens = None
        for key in (*SAMPLING_KEYS, "max_tokens"):
            text = self.query_one(f"#param-{key}", Input).value.strip()
            if not text:
                continue
            try:
                value = int(text) if key in ("top_k", "seed", "max_tokens") else float(text)
            except ValueError:
                self.notify(f"{key}: {text!r} is not a number", severity="error")
                return
            if key == "max_tokens":
                if value <= 0:
                    self.notify("max tokens must be > 0", severity="error")
                    return
                max_tokens = value
            else:
                overrides[key] = value
        effort = None
        if self.reads_reasoning_effort:
            value = self.query_one("#param-reasoning_effort", Select).value
            effort = value if isinstance(value, str) else None
        thinking = None
        if self.thinking_switch:
            value = self.query_one("#param-thinking", Select).value
            thinking = None if not isinstance(value, str) else value == "on"
        self.dismiss(SamplingChoice(overrides, max_tokens, effort, thinking))

    @on(Button.Pressed, "#reset")
    def reset(self) -> None:
        for field in self.query(Input):
            field.value = ""
        for select in self.query(Select):
            select.clear()

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


REPACK_DIR = "$XDG_CACHE_HOME/moechat/repacked"  # engine/cache/store.py default_repack_dir


def format_change_text(model: str, fmt: str, size: int | None, repacked: bool, native: str) -> str:
    """What a switch to `fmt` costs: the notice shown when the reload starts (and the dialog's body)."""
    from ..livestats import fmt_bytes

    if fmt == "native":
        return (f"Reloading {model} with its native experts ({native or 'as the checkpoint ships them'}); a "
                "repacked file written for another format stays on disk for a later switch.")
    where = f"{fmt_bytes(size)} repacked file" if size else "repacked file (as big as the experts in that format)"
    if repacked:
        return f"Reloading {model} with {fmt} experts, from the {where} written at an earlier start."
    return (f"Reloading {model} with {fmt} experts. The first start converts every expert once into a {where} "
            f"under {REPACK_DIR} (reused on later starts); for a big model that takes minutes.")


def format_quality(fmt: str) -> str:
    """The measured quality of a converted format (engine/plan/format_plan.py's QUALITY), one line."""
    from moechat.engine.plan.format_plan import QUALITY, QUALITY_SOURCE  # pure Python, no torch

    q = QUALITY.get(fmt)
    return "" if q is None else f"Measured: {q.describe()} ({QUALITY_SOURCE})."


class FormatScreen(ModalScreen[bool]):
    """Confirm a change of expert format: it reloads the model (and the first start in int8/int4 converts it)."""

    BINDINGS = CANCEL

    def __init__(self, model: str, fmt: str, size: int | None, repacked: bool, native: str):
        super().__init__(classes="dialog-screen")
        self.model, self.fmt = model, fmt
        self.text = format_change_text(model, fmt, size, repacked, native)

    def compose(self):
        with Vertical(classes="dialog") as box:
            box.border_title = f"Expert format: {self.fmt}"
            yield Label(self.text.replace("Reloading", "This reloads", 1), classes="hint", id="format-text",
                        markup=False)
            quality = format_quality(self.fmt)
            if quality:
                yield Label(quality, classes="hint", markup=False)
            yield Label("The chat stays; the reply being written is stopped. `moechat fit MODEL` compares the formats.",
                        classes="hint", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Reload", id="reload", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#reload")
    def _reload(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(False)


class ExportScreen(ModalScreen[str | None]):
    """Where to write a chat as Markdown: a folder, the data dir's exports/ offered. Enter or Ctrl+S writes."""

    BINDINGS = [*CANCEL, Binding("ctrl+s", "save", "Export")]

    def __init__(self, directory: str):
        super().__init__(classes="dialog-screen")
        self.directory = directory

    def compose(self):
        with Vertical(classes="dialog") as box:
            box.border_title = "Export to Markdown"
            yield Label("Folder to write the chat into (made if missing); the file is named after the chat.",
                        classes="hint")
            yield Input(self.directory, id="export-dir")
            with Horizontal(classes="buttons"):
                yield Button("Export", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#export-dir", Input).focus()

    @on(Input.Submitted, "#export-dir")
    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        directory = self.query_one("#export-dir", Input).value.strip()
        if not directory:
            self.notify("Type a folder to export into.", severity="warning")
            return
        self.dismiss(directory)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ModelPicker(Vertical):
    """A path input and the recent models; posts Input.Submitted / OptionList.OptionSelected upwards."""

    def __init__(self, recent: list[str], **kwargs):
        super().__init__(**kwargs)
        self.recent = recent

    def compose(self):
        yield Label("Model directory (or a Hub repo id already downloaded):", classes="hint")
        yield Input(placeholder="~/models/Qwen3-30B-A3B", id="model-path")
        if self.recent:
            yield Label("Recent:", classes="hint")
            yield OptionList(*self.recent, id="recent-models")
        yield Button("Get a model from the Hub… (F5)", id="open-setup")


class OpenModelScreen(ModalScreen[str | None]):
    BINDINGS = CANCEL

    def __init__(self, recent: list[str]):
        super().__init__(classes="dialog-screen")
        self.recent = recent

    def compose(self):
        with Vertical(classes="dialog") as box:
            box.border_title = "Open a model"
            yield ModelPicker(self.recent)

    @on(Input.Submitted, "#model-path")
    def _path(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(event.value.strip())

    @on(OptionList.OptionSelected, "#recent-models")
    def _recent(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.recent[event.option_index])

    @on(Button.Pressed, "#open-setup")
    def _setup(self) -> None:
        self.dismiss(None)
        self.app.open_setup()

    def action_cancel(self) -> None:
        self.dismiss(None)
