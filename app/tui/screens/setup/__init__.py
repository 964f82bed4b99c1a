"""The setup wizard: pick a model from the Hub, know before the download whether and how fast it runs here,
download it with progress and cancel, and land in the chat on it.

    this machine   GPU, free VRAM, link, RAM, disk             engine.hardware.probe (a worker)
    catalog        engine/plan/catalog.py's MoE models, one row each; each row's verdict and predicted tok/s from
                   config.json and the index alone (Hub.catalog, 4 rows at a time, filled in as they come)
    search         Hub search (Enter in the search box); supported families get the same verdicts
    plan           Enter on a row: the exact verdict from the safetensors headers (a ranged read of each shard's
                   first 100 kB, never a weight body), the memory plan's decisions with their reasons, and what
                   the download will do (cached files, partial files resumed, bytes to fetch)
    GGUF repo      a repo of GGUF quants and no safetensors: its row says what it offers (no config.json to plan
                   from); Enter lists each quant with its size, verdict and predicted tok/s, each from that quant's
                   header alone (ranged reads), the recommended one starred (engine/plan/hub/gguf.py
                   `recommend_quant`: the largest that runs with every expert in VRAM, or RAM without a GPU); [ and ]
                   mark another; D fetches the marked quant's files only and the chat opens on its first file
    download       Hub.download with a progress sink and a cancel Event: the bar, the rate, the file; Escape or
                   the Cancel button stop it within one chunk (what arrived is kept and resumed next time)
    done           the screen dismisses with the snapshot's path; the app opens the chat on it

Every Hub call blocks, so each runs in a thread worker and answers with the messages in messages.py; the engine
(huggingface_hub, the planner) is imported inside the workers, so opening the app stays torch-free. A verdict
for a 60 GB model reads about 2 MB. Errors are the engine's typed messages (gated, not found, no space, offline,
bad token), shown as notices and kept beside the row.

Offline (HF_HUB_OFFLINE, or the endpoint not answering a TCP connect within HUB_PROBE_TIMEOUT_S) the Hub is not
asked at all: downloaded models get their exact verdict from the local snapshot, the others an estimate from
what the catalog knows (`catalog_estimate`), marked "(est.)"; the Predicted column says the speed needs the Hub
(it needs config.json); search filters the catalog and says at once that the Hub itself is not searched.

Parts (each imports only those below it):

* ``screen.py``: ``SetupScreen``: layout, rows and whole columns, the workers' answers, the detail pane, actions.
* ``hub_calls.py``: the Hub calls the workers make (offline probe, row verdicts, search, exact plan, download).
* ``details.py``: the detail pane's texts (a row's brief, a picked model's exact plan and download).
* ``listing.py``: ``HubOptions``, the table's columns, each cell's text, ``catalog_estimate``, ``ModelTable``.
"""

from .listing import HubOptions, catalog_estimate
from .screen import SetupScreen

__all__ = ["HubOptions", "SetupScreen", "catalog_estimate"]
