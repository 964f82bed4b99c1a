"""The live panel beside the chat: throughput, hit rates, bytes moved, memory, heatmap and tuning.

It only draws what it is given: `show_stats(DashboardStats)` a few times a second from the bridge,
`MemorySampled` once a second from its own thread worker (psutil and NVML calls stay off the UI
thread), `show_model(ModelInfo)` once. Values sit in their own labels (ids below) so tests and a
person's eye find them in the same place.

Cheap to refresh by construction: every value label has a fixed width (set in moechat.tcss), so an
update repaints that label without a layout pass of the whole screen (a reflow costs ~10 ms of the
GIL that the generating thread also needs), and a value that did not change is not touched. A value is a
`FitLabel` (widgets/text.py): given a shorter form, it shows the longest that fits its width, and it never
shows part of a word (the app's RSS in a 50-column panel was "app 306", its unit cut off).
"""

from __future__ import annotations

import math

from textual import work
from textual.containers import Horizontal, Vertical
from textual.widgets import Label

from ..livestats import DashboardStats, fmt_bytes, fmt_pct, fmt_rate
from ..messages import MemorySampled, ModelInfo
from ..sysmon import MemoryReading
from .heatmap import CacheHeatmap, HeatmapLegend
from .sparkline import FastSparkline
from .text import FitLabel, plural
from .tuning import TuningPanel

MEMORY_INTERVAL_S = 1.0
SPARK_POINTS = 40  # the sparkline always spans this many samples, so a short history starts at the right


def _row(key: str, *values: tuple[str, str], key_id: str | None = None) -> Horizontal:
    """A 'key  value value' line; each value a FitLabel with an id (and a fixed width in the tcss)."""
    return Horizontal(Label(key, id=key_id, classes="key"),
                      *(FitLabel(text, id=id_, classes="value") for id_, text in values),
                      classes="stat-row")


def prefetch_text(s: DashboardStats) -> str:
    """'312/400 used': prefetched experts that were then used, of those issued, since load."""
    if s.prefetch == "off" and not s.prefetch_issued:
        return "off"
    return f"{s.prefetch_used:,}/{s.prefetch_issued:,} used"


def hit_counts_text(s: DashboardStats) -> str:
    """'1,204 hits · 96 misses' and, when misses may run on the host, '(40 on host)'."""
    if not s.has_cache:
        return "no cache"
    if s.fast_tier == "ram":  # a CPU: every expert computed where it lives; a miss is a read from disk
        text = f"{s.hits:,} from RAM · {s.misses:,} from disk"
        return text + (f" ({s.host_computed:,} run on the host)" if s.host_computed else "")
    text = f"{plural(s.hits, 'hit')} · {plural(s.misses, 'miss', 'misses')}"
    if s.on_miss != "load" or s.host_computed:
        text += f" ({s.host_computed:,} on host)"
    return text


def tier_text(s: DashboardStats) -> str:
    """The fast tier's line: slots in use, or on a CPU the RAM tier over the disk."""
    if s.fast_tier != "ram":
        return f"{s.slots_used}/{s.num_slots} used · {s.policy}"
    if not s.ram_cache_bytes:
        return f"RAM: all {plural(s.ram_tier_experts, 'expert')}, none from disk"
    held = s.ram_cache_used_bytes // s.expert_bytes if s.expert_bytes else 0
    return f"RAM {held:,}/{s.ram_tier_experts:,} experts · {fmt_bytes(s.ram_cache_bytes)} · {s.policy}"


def _used_free(used: int, free: int) -> str:
    """'12.0 GiB used · 20.0 GiB free' (every number with its unit)."""
    return f"{fmt_bytes(used)} used · {fmt_bytes(free)} free"


class Dashboard(Vertical):
    def __init__(self, policies: tuple[str, ...], memory_probe=None, prefetch_modes: tuple[str, ...] = (), **kwargs):
        super().__init__(**kwargs)
        self.policies = policies
        self.prefetch_modes = prefetch_modes
        self.memory_probe = memory_probe
        self.stats = DashboardStats()
        self._shown: dict[str, str] = {}  # label id -> text on screen

    def compose(self):
        yield _row("tok/s", ("prefill-tps", "prefill –"), ("decode-tps", "decode –"))
        yield FastSparkline(id="decode-spark")
        # this reply's hit rate beside the session's: after a retune the session's hides what the cache does now
        yield _row("hits", ("turn-hit-rate", "turn –"), ("hit-rate-label", "session"), ("hit-rate", "–"))
        yield _row("", ("hit-counts", ""))
        yield _row("slots", ("slots-used", "–"), key_id="tier-key")
        yield _row("moved", ("bytes-ram", "RAM –"), ("bytes-disk", "disk –"))
        yield _row("fetch", ("prefetch-used", "–"), ("stall", ""))
        yield _row("RAM", ("ram", "–"), ("ram-app", ""))
        yield _row("VRAM", ("vram", "–"))
        yield CacheHeatmap(id="heatmap")
        yield HeatmapLegend(id="legend")
        yield TuningPanel(self.policies, self.prefetch_modes, id="tuning")

    def on_mount(self) -> None:
        if self.memory_probe is not None:
            self.sample_memory()
            self.set_interval(MEMORY_INTERVAL_S, self.sample_memory)

    # -- memory ---------------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="memory", exit_on_error=False)
    def sample_memory(self) -> None:
        try:
            reading = self.memory_probe.read()
        except Exception:  # noqa: BLE001 - a failed probe leaves the last numbers up
            return
        self.post_message(MemorySampled(reading))

    def on_memory_sampled(self, message: MemorySampled) -> None:
        message.stop()
        self.show_memory(message.reading)

    def _set(self, id_: str, text: str, *shorter: str) -> None:
        """Show `text` in the value label `id_`, or the first of the `shorter` forms that fits its width."""
        key = "\0".join((text, *shorter))
        if self._shown.get(id_) != key:
            self._shown[id_] = key
            label = self.query_one(f"#{id_}")
            if isinstance(label, FitLabel):
                label.set_texts(text, *shorter)
            else:  # a key label
                label.update(text, layout=False)

    def show_memory(self, m: MemoryReading) -> None:
        self._set("ram", _used_free(m.ram_used_bytes, m.ram_available_bytes))
        # the app's own RSS where it fits whole, else nothing (hidden in a narrow panel by the tcss)
        self._set("ram-app", f"· app {fmt_bytes(m.process_rss_bytes)}", "")
        if m.gpus:
            self._set("vram", " | ".join(_used_free(g.used_bytes, g.free_bytes) for g in m.gpus))
        else:
            self._set("vram", f"n/a ({m.vram_note})")

    # -- model and stats ------------------------------------------------------------------------------
    def show_model(self, info: ModelInfo | None, loading: str | None = None, tuning_note: str | None = None) -> None:
        """The loaded model (None: `loading` says what happens); `tuning_note`: why no knob can act here (a remote
        server), shown in place of the knobs."""
        heatmap = self.query_one(CacheHeatmap)
        if info is None:
            heatmap.set_placeholder(loading or "waiting for the model…")
            return
        tuning = self.query_one(TuningPanel)
        if tuning_note:
            tuning.show_unavailable(tuning_note)
        if info.cache is None:
            heatmap.set_placeholder("the server exports no expert cache" if tuning_note else
                                    "no expert cache: every expert is resident; set slots below to cache")
        else:
            heatmap.set_placeholder("no routing yet: send a message")
        tuning.show_state(info.cache)
        tuning.show_format(info)

    def show_stats(self, s: DashboardStats) -> None:
        self.stats = s
        q = self.query_one
        if s.has_cache:
            q(TuningPanel).show_on_miss(s.on_miss)
        self._set("prefill-tps", f"prefill {fmt_rate(s.prefill_tps)}")
        self._set("decode-tps", f"decode {fmt_rate(s.decode_tps)}")
        history = list(s.decode_history[-SPARK_POINTS:])
        q("#decode-spark", FastSparkline).set_data([0.0] * (SPARK_POINTS - len(history)) + history if history else [])
        self._set("turn-hit-rate", f"turn {fmt_pct(s.turn_hit_rate)}")
        self._set("hit-rate", fmt_pct(s.hit_rate))
        self._set("hit-counts", hit_counts_text(s))
        if s.has_cache:
            self._set("tier-key", "cache" if s.fast_tier == "ram" else "slots")
            self._set("slots-used", tier_text(s))
        self._set("bytes-ram", f"RAM {fmt_bytes(s.bytes_per_token_ram)}/tok")
        self._set("bytes-disk", f"disk {fmt_bytes(s.bytes_per_token_disk)}/tok")
        if s.has_cache:
            self._set("prefetch-used", prefetch_text(s))
            stall = s.stall_ms_per_token
            if stall is None:
                self._set("stall", "")
            else:
                self._set("stall", f"stall {stall:.2f} ms/tok", f"stall {stall:.2f}ms", f"{stall:.2f}ms")
        heatmap = q(CacheHeatmap)
        if s.has_cache and s.resident is not None and s.resident.size:
            rates = s.layer_hit_rates or tuple(math.nan for _ in range(s.resident.shape[0]))
            heatmap.set_data(s.resident, s.recent, rates, s.hosted)
            legend = q(HeatmapLegend)
            hosting = s.fast_tier != "ram" and (s.on_miss != "load" or s.host_computed > 0)  # CPU: all on the host
            if legend.hosting != hosting:
                legend.hosting = hosting
