"""What bare `moechat` shows when there is no demo model and no model used before."""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, OptionList

from ..widgets.header import ScreenHeader
from .dialogs import ModelPicker

WELCOME = """\
# Welcome to moechat

Run a Mixture-of-Experts model that is bigger than your GPU, and watch its expert cache work:
hot experts stay in a fixed pool of slots, the rest wait in RAM or on disk.

{reason}

Open a local Hugging Face model directory (`config.json` and `*.safetensors`; Qwen3-MoE, Mixtral,
OLMoE) from the command line:

```
moechat chat ~/models/Qwen3-30B-A3B --expert-slots 512 --ram-cache-mb 16000
```

or type its path below. `moechat chat --help` lists the options.

No model yet? **F5** (or the button below) opens the model setup: the catalog of MoE models with a
verdict and a predicted speed for this machine, Hub search, the plan for the one you pick, then the
download, straight into the chat.
"""

NO_MODEL = ("There is no model to open yet: the bundled demo model (`assets/demo-moe`) is not there and no "
            "model has been used before.")


class WelcomeScreen(Screen):
    BINDINGS = [Binding("f5", "setup", "Get models")]

    def __init__(self, recent: list[str], reason: str = NO_MODEL):
        super().__init__()
        self.recent = recent
        self.reason = reason

    def compose(self):
        yield ScreenHeader(icon="◆")
        with VerticalScroll(id="welcome-scroll"):
            with Vertical(id="welcome"):
                from textual.widgets import Markdown  # here: markdown-it is ~0.1 s the chat's first frame skips

                yield Markdown(WELCOME.format(reason=self.reason), id="welcome-text")
                yield ModelPicker(self.recent, id="welcome-picker")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#model-path", Input).focus()

    @on(Input.Submitted, "#model-path")
    def _path(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.app.open_model(event.value.strip())

    @on(OptionList.OptionSelected, "#recent-models")
    def _recent(self, event: OptionList.OptionSelected) -> None:
        self.app.open_model(self.recent[event.option_index])

    @on(Button.Pressed, "#open-setup")
    def action_setup(self) -> None:
        self.app.open_setup()
