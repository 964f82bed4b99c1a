"""Where a miss runs: loaded into a slot, or computed on the host where it already lives.

A miss can be served two ways (docs/architecture.md, "Hybrid execution"):

* load: copy the expert's packed bytes over the link into a slot, then compute on the device:
  t_load = bytes / link + t_dev(n); later uses in a slot cost t_dev each.
* host: compute it on the CPU straight from the RAM tier, no copy: t_host(n) = bytes / host read rate +
  n * flops / host rate; later uses cost t_host again (it was not slotted).

With r the expected further uses while it would stay in a slot, a miss is cheaper on the host by
    margin = t_load + t_dev(n) + r t_dev(1) - (t_host(n) + r t_host(1)).
A layer's host experts run as one pass, whose fixed cost (on CUDA two activation copies and their
synchronisation, `ACTIVATION_COPY_S` each) is paid once however many experts it holds: the misses with a
positive margin go to the host when their margins together exceed it, else every miss loads (`place`). On a
CPU the host experts join the slotted ones in the step's one pass (engine/layers/experts.py: no second pass, no fixed
cost).
At batch 1 on a PC the host usually wins (GPT-OSS-20B: 13.2 MB over a 25 GB/s link is 0.53 ms; reading it
at ~40 GB/s and 45 MFLOP at ~200 GFLOP/s is ~0.55 ms, and no slot is evicted), a prefill chunk with many
tokens on one expert loads, and a hot expert (large r) loads. On a CPU-only machine the "device" is the
host, so a load only adds a memcpy: the host always wins, which is "compute in place from the RAM tier".

The numbers are measured: the host rates by timing one expert at start (`calibrate`), then refined from
every host step; the link from the hardware probe (or the measured demand loads). Pure Python over
numbers: the decisions are tested on injected hardware figures.
"""

from __future__ import annotations

from dataclasses import dataclass

ON_MISS = ("load", "host", "auto")
REUSE_HORIZON = 8  # steps an expert that is loaded now is expected to stay useful in a slot
# Raw GB/s per lane after line encoding, by PCIe generation (8b/10b for 1-2, 128b/130b for 3-5, FLIT for 6).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_EFFICIENCY = 0.8  # usable fraction of the raw rate for large host->device DMA copies
# Assumed when the link cannot be probed (docs/plan.md lists every assumption).
ASSUMED_LINK_GBPS = round(PCIE_LANE_GBPS[4] * 16 * PCIE_EFFICIENCY, 1)  # PCIe 4.0 x16, usable: 25.2
ACTIVATION_COPY_S = 20e-6  # one small host<->device copy plus its synchronisation, on CUDA


def check_on_miss(mode: str) -> None:
    if mode not in ON_MISS:
        raise ValueError(f"--on-miss must be one of {', '.join(ON_MISS)}, got {mode!r}")


@dataclass
class MissCostModel:
    """Seconds for serving one missed expert each way, from bytes, tokens and rates."""

    expert_bytes: int
    expert_flops: float  # per token: 2 x (2I x H + H x I) multiply-adds
    link_gbps: float | None  # host -> device; None on a CPU-only machine (the device is the host)
    host_gbps: float  # reading packed expert bytes and computing from them, effective
    host_gflops: float
    device_gbps: float | None = None  # device memory bandwidth (None: same as the host)
    device_gflops: float | None = None
    host_samples: int = 0

    @property
    def same_machine(self) -> bool:
        return self.link_gbps is None

    def t_host(self, tokens: int) -> float:
        return self.expert_bytes / (self.host_gbps * 1e9) + tokens * self.expert_flops / (self.host_gflops * 1e9)

    @property
    def host_pass_s(self) -> float:
        """The fixed cost of a layer's host pass: two activation copies on CUDA; none on a CPU (one joint pass)."""
        return 0.0 if self.same_machine else 2 * ACTIVATION_COPY_S

    def t_device(self, tokens: int) -> float:
        if self.same_machine or self.device_gbps is None or self.device_gflops is None:
            return self.t_host(tokens) if self.same_machine else 0.0
        return self.expert_bytes / (self.device_gbps * 1e9) + tokens * self.expert_flops / (self.device_gflops * 1e9)

    def t_load(self) -> float:
        if self.same_machine:  # a memcpy from the RAM tier into a RAM slot, at about the read rate
            return self.expert_bytes / (self.host_gbps * 1e9)
        return self.expert_bytes / (self.link_gbps * 1e9)

    def margin(self, tokens: int, reuse: float) -> float:
        """Seconds saved by computing on the host (negative: loading is cheaper), the host pass's cost aside."""
        load = self.t_load() + self.t_device(tokens) + reuse * self.t_device(1)
        return load - (self.t_host(tokens) + reuse * self.t_host(1))

    def decide(self, tokens: int, reuse: float) -> tuple[str, str]:
        """("load" | "host", why in numbers) for an expert that `tokens` tokens need now and that is expected
        to be used `reuse` more times soon, alone on the host (it pays the host pass)."""
        load = self.t_load() + self.t_device(tokens) + reuse * self.t_device(1)
        host = self.t_host(tokens) + reuse * self.t_host(1) + self.host_pass_s
        choice = "load" if load < host else "host"
        return choice, (f"{tokens} token(s), reuse {reuse:.1f}: load {load * 1e3:.3f} ms vs host {host * 1e3:.3f} ms "
                        f"-> {choice}")

    def place(self, needs: list[tuple[int, float]]) -> list[bool]:
        """One layer's misses, each (tokens needing it now, expected reuse) -> on the host or not: those with a
        positive margin, when together they save more than the host pass costs."""
        margins = [self.margin(tokens, reuse) for tokens, reuse in needs]
        saved = sum(m for m in margins if m > 0)
        if saved <= self.host_pass_s:
            return [False] * len(needs)
        return [m > 0 for m in margins]

    def observe_host(self, tokens: int, seconds: float) -> None:
        """Refine the host rate from a measured host computation (exponential average of the implied rate)."""
        if seconds <= 0:
            return
        predicted = self.t_host(tokens)
        ratio = max(0.25, min(4.0, predicted / seconds))  # >1: the host is faster than believed
        w = 0.2 if self.host_samples > 4 else 0.5
        self.host_gbps *= 1 + w * (ratio - 1)
        self.host_gflops *= 1 + w * (ratio - 1)
        self.host_samples += 1

    def to_json(self) -> dict:
        return {"expert_bytes": self.expert_bytes, "link_gbps": self.link_gbps, "host_gbps": round(self.host_gbps, 2),
                "host_gflops": round(self.host_gflops, 2), "t_load_ms": round(self.t_load() * 1e3, 4),
                "t_host_1_ms": round(self.t_host(1) * 1e3, 4)}
