"""`GET /metrics` of `moechat serve`: Prometheus text format, every name prefixed `moechat_`.

Request metrics are prometheus_client instruments the engine thread updates as it goes. The expert
cache's come from the latest `CacheSnapshot` the engine thread took (after each request and every
half second while one generates, between two tokens): a scrape never touches the live cache, so it
cannot race the generating thread or slow it. Per-layer series are labelled `layer` (L series per
metric: 61 for DeepSeek-V3); per-expert residency is not exported (L x E = 15,616 series would be a
cardinality Prometheus users are told to avoid).

The names are read back by `moechat chat --remote` (app/tui/remote.py), which rebuilds a snapshot for the
cache panel from them; keep the two in step.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self, worker_snapshot, info: dict[str, str]):
        """`worker_snapshot`: a callable returning the latest CacheSnapshot or None."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("moechat_requests", "Requests finished, by endpoint and status (ok, rejected, "
                                "cancelled, error)", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("moechat_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("moechat_generated_tokens", "Tokens generated", registry=r)
        self.prefill_tps = Gauge("moechat_prefill_tokens_per_second", "Prefill speed of the last request",
                                 registry=r)
        self.decode_tps = Gauge("moechat_decode_tokens_per_second", "Decode speed of the last request", registry=r)
        self.latency = Histogram("moechat_request_duration_seconds", "Time from arrival to the last token, queue "
                                 "wait included", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("moechat_time_to_first_token_seconds", "Time from arrival to the first generated "
                              "token, queue wait included", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("moechat_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("moechat_requests_running", "Requests generating (0 or 1: one sequence at a time)",
                             registry=r)
        self.after_cancel = Counter("moechat_tokens_after_cancel", "Tokens generated after the client had gone or "
                                    "cancelled (the engine stops before its next token: at most 1 per request)",
                                    registry=r)
        self.rejected = Counter("moechat_http_errors", "Requests refused before the engine, by HTTP status",
                                ["status"], registry=r)
        Gauge("moechat_info", "The served model and cache configuration", list(info), registry=r).labels(
            **info).set(1)
        r.register(_CacheCollector(worker_snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CacheCollector:
    def __init__(self, snapshot):
        self.snapshot = snapshot

    def describe(self):
        return []  # collected lazily: the families depend on whether the model has a cache

    def collect(self):
        snap = self.snapshot()
        enabled = GaugeMetricFamily("moechat_expert_cache_enabled", "1 when experts are cached in slots, 0 when "
                                    "every expert is resident")
        enabled.add_metric([], 0 if snap is None else 1)
        yield enabled
        if snap is None:
            return
        layers = [str(i) for i in range(len(snap.hits))]
        config = GaugeMetricFamily("moechat_expert_cache_config", "The cache's current policy, prefetch mode and "
                                   "depth, and where misses run", labels=["policy", "prefetch", "prefetch_depth",
                                                                          "on_miss"])
        config.add_metric([snap.policy, snap.prefetch, str(snap.prefetch_depth), snap.on_miss], 1)
        yield config

        def per_layer(name, doc, values, counter=True):
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["layer"])
            for layer, value in zip(layers, values, strict=False):
                if counter or not math.isnan(value):
                    family.add_metric([layer], value)
            return family

        def single(name, doc, value, counter=False):
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc)
            family.add_metric([], value)
            return family

        yield per_layer("moechat_expert_cache_hits", "Expert requests served from a slot", snap.hits)
        yield per_layer("moechat_expert_cache_misses", "Expert requests that were not in a slot", snap.misses)
        yield per_layer("moechat_expert_cache_layer_hit_rate", "hits / (hits + misses) per layer",
                        snap.layer_hit_rates, counter=False)
        if not math.isnan(snap.hit_rate):
            yield single("moechat_expert_cache_hit_rate", "hits / (hits + misses), all layers", snap.hit_rate)
        moved = CounterMetricFamily("moechat_expert_bytes_moved", "Expert bytes read from each tier into slots",
                                    labels=["tier"])
        moved.add_metric(["ram"], snap.bytes_from_ram)
        moved.add_metric(["disk"], snap.bytes_from_disk)
        yield moved
        loads = CounterMetricFamily("moechat_expert_loads", "Expert loads by phase", labels=["phase"])
        loads.add_metric(["prefill"], snap.expert_loads_prefill)
        loads.add_metric(["decode"], snap.expert_loads_decode)
        yield loads
        if snap.prefetch_issued:
            yield per_layer("moechat_prefetch_issued", "Expert loads started ahead of need", snap.prefetch_issued)
            yield per_layer("moechat_prefetch_used", "Prefetched experts used", snap.prefetch_used)
            yield per_layer("moechat_prefetch_wasted", "Prefetched experts evicted or cancelled unused",
                            snap.prefetch_wasted)
            yield per_layer("moechat_prefetch_late", "Prefetched experts still loading when needed",
                            snap.prefetch_late)
        if snap.host_computed:
            yield per_layer("moechat_expert_host_computed", "Misses computed on the host (hybrid)",
                            snap.host_computed)
        yield single("moechat_expert_stall_seconds", "Time the forward pass waited for expert bytes",
                     snap.stall_seconds, counter=True)
        yield single("moechat_expert_slots", "Expert slots on the compute device", snap.num_slots)
        yield single("moechat_expert_slots_used", "Slots holding an expert", snap.slots_used)
        yield single("moechat_ram_tier_budget_bytes", "Budget of the RAM tier (0: every expert in RAM)",
                     snap.ram_cache_bytes)
        yield single("moechat_ram_tier_used_bytes", "Bytes the RAM tier holds", snap.ram_cache_used_bytes)
        yield single("moechat_experts_per_layer", "Routed experts per MoE layer (E)", int(snap.resident.shape[1]))
