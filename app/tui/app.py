"""The Textual app: a chat with a live view of the expert cache. Built by `make_app`.

    app = make_app("path/to/model")                 # the real engine, loaded in a worker thread
    app = make_app(model, engine_factory=fake)      # tests: any object with the engine's methods

The app holds what every screen shares (settings, the chat store, the engine factory and load
options, the memory probe, where the Hub is) and picks the first screen: the chat on a model, or the
welcome screen. The setup wizard (`open_setup`, F5 in the chat and on the welcome screen) downloads a
model from the Hub and opens the chat on it.
Importing this module imports neither torch nor the engine (tests/app/test_imports.py).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from textual.app import App
from textual.binding import Binding

from ..cli.pull import DEMO_MODEL
from .bridge import EngineFactory, LoadOptions, load_engine
from .screens.chat import ChatScreen
from .screens.setup import HubOptions, SetupScreen
from .screens.welcome import NO_MODEL, WelcomeScreen
from .settings import Settings, data_dir
from .store import ChatStore
from .sysmon import MemoryProbe

DEMO_NOTICE = ("The bundled 10 M-parameter demo model answers \"What does X do?\" for Python's standard library "
               "(try: What does json.dumps do?). F5: real MoE models with a verdict and a predicted speed for this "
               "machine, then the download, straight into the chat.")


class MoechatApp(App):
    CSS_PATH = "moechat.tcss"
    # Quit shown in every footer (Textual's own Ctrl+Q binding is hidden)
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]
    TITLE = "moechat"
    ENABLE_COMMAND_PALETTE = False
    # Why the panel's knobs cannot act, shown in their place (`moechat chat --remote`: the server tunes its own
    # cache, app/tui/remote.py sets it); None: they can.
    tuning_note: str | None = None

    def __init__(self, model: str | None, *, engine_factory: EngineFactory, options: LoadOptions,
                 settings: Settings, store: ChatStore, memory_probe, export_dir: Path,
                 welcome_reason: str = NO_MODEL, notices: tuple[str, ...] = (), hub: HubOptions | None = None,
                 reasoning_effort: str | None = None, sampling: dict | None = None, max_tokens: int | None = None,
                 thinking: bool | None = None):
        super().__init__()
        self.model = model
        self.engine_factory = engine_factory
        self.load_options = options
        self.settings = settings
        self.store = store
        # the chat DB stopped taking writes (locked, full, read-only): the session goes on in memory; say so
        store.on_problem = lambda message: self.notify(message, title="Chats", severity="error", timeout=20)
        self.memory_probe = memory_probe
        self.export_dir = export_dir  # where Ctrl+S offers to write (the data dir's exports/ unless given)
        self.reopen_last_chat = True  # the chat screen opens the chat the app was closed on
        self.welcome_reason = welcome_reason
        self.hub = hub or HubOptions()
        # `moechat chat --reasoning-effort`: this session only, until a choice in the sampling dialog (saved)
        self.reasoning_effort = reasoning_effort
        self.thinking = thinking  # `moechat chat --thinking on|off`: the same, for the thinking switch
        # `moechat chat --temperature ... --max-tokens`: over the saved settings for this session only (never
        # saved), until a choice in the sampling dialog replaces them
        self.session_sampling, self.session_max_tokens = dict(sampling or {}), max_tokens
        # `moechat chat MODEL --expert-format`: for that model in this session, until a choice in the panel (saved)
        self.session_formats = {model: options.expert_format} if model and options.expert_format else {}
        self.startup_notices = [n for n in (*notices, settings.problem, getattr(store, "notice", None)) if n]

    def on_mount(self) -> None:
        if self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        if self.model:
            # the demo model: a line above the prompt says where real models come from (not a toast over the knobs)
            self.push_screen(ChatScreen(self.model, hint=DEMO_NOTICE if Path(self.model) == DEMO_MODEL else ""))
        else:
            self.push_screen(WelcomeScreen(self.settings.recent_models, self.welcome_reason))
        for notice in self.startup_notices:
            self.notify(notice, severity="warning", timeout=10)

    def prompt_history(self) -> list[str]:
        """What the user sent before, oldest first (the prompt's Up key walks it back): kept in the chat store."""
        return self.store.recent_prompts()

    def sampling(self) -> tuple[dict, int | None]:
        """(sampling overrides, max tokens) for the next reply: the saved settings, under this session's flags."""
        max_tokens = self.settings.max_tokens if self.session_max_tokens is None else self.session_max_tokens
        return {**self.settings.sampling, **self.session_sampling}, max_tokens

    def choose_sampling(self) -> None:
        """A choice made in the sampling dialog (now in the settings) replaces this session's flags."""
        self.session_sampling, self.session_max_tokens = {}, None

    def expert_format(self, model: str) -> str:
        """The --expert-format to load `model` with: this session's flag, else the one saved for it, else native."""
        return self.session_formats.get(model) or self.settings.expert_format(model)

    def choose_expert_format(self, model: str, fmt: str) -> str | None:
        """Remember `fmt` for `model` (saved; replaces this session's flag); returns a problem to show, or None."""
        self.session_formats.pop(model, None)
        self.settings.set_expert_format(model, fmt)
        return self.settings.save()

    def open_model(self, model: str) -> None:
        """Chat on `model`: the chat screen on top reloads; any other (the welcome screen) is replaced by a chat."""
        self.model = model
        screen = self.screen
        if isinstance(screen, ChatScreen):
            screen.call_later(screen._reload, model)
        else:
            self.switch_screen(ChatScreen(model))

    def open_setup(self) -> None:
        """The setup wizard; the model it downloads (or picks from the cache) opens in the chat."""

        def done(model: str | None) -> None:
            if model:
                self.open_model(model)

        self.push_screen(SetupScreen(self.hub), done)

    def on_unmount(self) -> None:
        self.store.close()


def make_app(model: str | os.PathLike | None = None, *, engine_factory: EngineFactory | None = None,
             options: LoadOptions | None = None, settings: Settings | None = None,
             store: ChatStore | None = None, memory_probe=None, export_dir: str | os.PathLike | None = None,
             welcome_reason: str = NO_MODEL, hub: HubOptions | None = None,
             reasoning_effort: str | None = None, sampling: dict | None = None,
             max_tokens: int | None = None, thinking: bool | None = None) -> MoechatApp:
    """The app on `model` (a directory or cached Hub repo id), or the welcome screen when None.

    Defaults: settings from the XDG config dir, chats in the XDG data dir, the real engine, psutil (+
    NVML when present) for memory, exports offered in the data dir's exports/, the Hub and cache of the environment
    (`hub`: another endpoint, cache, catalog or what-if hardware for the setup wizard), and the reasoning
    effort and thinking switch saved in the settings (`reasoning_effort` and `thinking` override them for this
    session; so do `sampling`, SamplingParams' names -> values, and `max_tokens` over the saved sampling settings).
    """
    notices = []
    settings = settings if settings is not None else Settings.load()
    if store is None:
        try:
            store = ChatStore()
        except (OSError, sqlite3.Error) as e:
            notices.append(f"Chats cannot be saved ({e}); this session keeps them in memory only.")
            store = ChatStore(":memory:")
    return MoechatApp(None if model is None else str(model), engine_factory=engine_factory or load_engine,
                      options=options or LoadOptions(), settings=settings, store=store,
                      memory_probe=memory_probe if memory_probe is not None else MemoryProbe(),
                      export_dir=Path(export_dir) if export_dir is not None else data_dir() / "exports",
                      welcome_reason=welcome_reason, notices=tuple(notices), hub=hub,
                      reasoning_effort=reasoning_effort, sampling=sampling, max_tokens=max_tokens,
                      thinking=thinking)
