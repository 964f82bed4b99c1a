"""Where things live on disk, shared by the Hub client and the planner (both import it; it imports nothing of
moechat): the Hugging Face cache that `moechat pull` downloads into."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """The standard Hugging Face cache: HF_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"
