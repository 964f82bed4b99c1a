"""The Textual app: a chat with a live view of the expert cache. Built by `make_app`.

    app = make_app("path/to/model")                 # the real engine, loaded in a worker thread
    app = make_app(model, engine_factory=fake)      # tests: any object with the engine's methods

The app holds what every screen shares (settings, the chat store, the engine factory and load
options, the memory probe) and picks the first screen: the chat on a model, or the welcome screen.
Importing this module imports neither torch nor the engine (tests/app/test_imports.py).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from textual.app import App

from .bridge import EngineFactory, LoadOptions, load_engine
from .screens.chat import ChatScreen
from .screens.welcome import NO_MODEL, WelcomeScreen
from .settings import Settings
from .store import ChatStore
from .sysmon import MemoryProbe


class MoechatApp(App):
    CSS_PATH = "moechat.tcss"
    TITLE = "moechat"
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, model: str | None, *, engine_factory: EngineFactory, options: LoadOptions,
                 settings: Settings, store: ChatStore, memory_probe, export_dir: Path,
                 welcome_reason: str = NO_MODEL, notices: tuple[str, ...] = ()):
        super().__init__()
        self.model = model
        self.engine_factory = engine_factory
        self.load_options = options
        self.settings = settings
        self.store = store
        self.memory_probe = memory_probe
        self.export_dir = export_dir
        self.welcome_reason = welcome_reason
        self.startup_notices = [n for n in (*notices, settings.problem) if n]

    def on_mount(self) -> None:
        if self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        if self.model:
            self.push_screen(ChatScreen(self.model))
        else:
            self.push_screen(WelcomeScreen(self.settings.recent_models, self.welcome_reason))
        for notice in self.startup_notices:
            self.notify(notice, severity="warning", timeout=10)

    def open_model(self, model: str) -> None:
        """From the welcome screen: replace it with a chat on `model`."""
        self.model = model
        self.switch_screen(ChatScreen(model))

    def on_unmount(self) -> None:
        self.store.close()


def make_app(model: str | os.PathLike | None = None, *, engine_factory: EngineFactory | None = None,
             options: LoadOptions | None = None, settings: Settings | None = None,
             store: ChatStore | None = None, memory_probe=None, export_dir: str | os.PathLike | None = None,
             welcome_reason: str = NO_MODEL) -> MoechatApp:
    """The app on `model` (a directory or cached Hub repo id), or the welcome screen when None.

    Defaults: settings from the XDG config dir, chats in the XDG data dir, the real engine, psutil (+
    NVML when present) for memory, exports to the current directory.
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
                      export_dir=Path(export_dir) if export_dir is not None else Path.cwd(),
                      welcome_reason=welcome_reason, notices=tuple(notices))
