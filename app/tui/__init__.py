"""The terminal app (Textual): the app and its entry points, the bridge (the only module that talks to the engine,
from worker threads), the live panel's numbers, the chat session and its SQLite store, settings, and the screens
and widgets. `remote.py` puts an OpenAI-compatible server behind the same app."""
