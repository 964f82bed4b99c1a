"""The model-loading banner over the transcript: a spinner and the stage, or the load error."""

from __future__ import annotations

from textual.containers import Horizontal
from textual.widgets import Label, LoadingIndicator


class LoadingPanel(Horizontal):
    def compose(self):
        yield LoadingIndicator()
        yield Label("starting…", id="loading-stage", markup=False)

    def show_stage(self, model: str, stage: str, elapsed: float) -> None:
        self.remove_class("-error")
        self.display = True
        self.query_one(LoadingIndicator).display = True
        self.query_one("#loading-stage", Label).update(f"Loading {model}: {stage} ({elapsed:.1f} s)")

    def show_error(self, model: str, error: str) -> None:
        self.add_class("-error")
        self.display = True
        self.query_one(LoadingIndicator).display = False
        self.query_one("#loading-stage", Label).update(
            f"Could not load {model}: {error}\nCtrl+L opens another model; saved chats stay readable (Ctrl+O).")

    def hide(self) -> None:
        self.display = False
