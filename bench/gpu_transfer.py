"""Link probe for expert misses: pinned RAM -> device as one copy per expert and as one per named tensor, a layer of
misses on the copy stream while the compute stream works, and the device-to-device copy rate.

    python bench/gpu_transfer.py [--device cuda] [--reps 20] [--json]
    python bench/gpu_transfer.py --dry-run          # builds the same objects on the CPU and checks the bytes

The expert is GPT-OSS-20B's in MXFP4 (2880 x 2880, biases): 13,236,480 bytes in six tensors (w13 blocks 8.29 MB,
w2 blocks 4.15 MB, the scales 518 and 259 KB, the biases 11.5 and 5.8 KB), laid out by the project's own
`SlotLayout` (13,236,736 bytes with the 256-byte alignment) in a `SlotPool` on the device and a pinned host buffer
of the RAM tier's layout. Each figure is the median over --reps timed by CUDA events (no host time inside):

* one copy:   the slot's row from the pinned row (what `CachedProvider` issues for a miss);
* six copies: tensor by tensor into the slot's views (what a miss cost before the one-buffer slot);
* layer:      K = 4 misses issued together on `CopyStream` while the compute stream runs a GEMM: the copy
              time, the GEMM time alone, and the two overlapped (a miss hidden behind compute costs nothing);
* d2d:        device -> device copy of the same bytes (the device's copy rate, the kernels' yardstick).

Aims (issue 28, H200): a miss at >= 0.8 of the link rate. Runs in well under a minute on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from moechat.engine.cache.slots import SlotLayout, SlotPool
from moechat.engine.cache.transfer import CopyStream, RecordingStream
from moechat.engine.quant.mxfp4 import MXFP4

H = I = 2880  # GPT-OSS-20B hidden and expert intermediate size
K = 4  # its top-k: the misses of one layer at worst


def expert_layout() -> SlotLayout:
    return SlotLayout(MXFP4.layout(H, I, torch.bfloat16, bias=True))


def _timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds of fn() over reps, by CUDA events on the current stream (after one warm-up)."""
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(device: torch.device, reps: int) -> dict:
    layout = expert_layout()
    pool = SlotPool(2 * K, 1, 2 * K, layout.shapes, device)  # [C, slot_bytes] on the device
    host_raw, host = layout.empty(K, pin=True)  # the RAM tier's rows, pinned
    host_raw.random_(0, 256)
    nbytes = layout.nbytes
    dst = pool.raw_of(0)

    def one() -> None:
        dst.copy_(host_raw[0], non_blocking=True)

    views = pool.views(1)

    def six() -> None:
        for name, t in views.items():
            t.copy_(host[name][0], non_blocking=True)

    t_one, t_six = _timed(one, reps, device), _timed(six, reps, device)
    assert torch.equal(pool.raw_of(0).cpu(), host_raw[0]), "one-copy bytes differ"
    same = all(torch.equal(views[n].cpu().view(torch.uint8), host[n][0].view(torch.uint8)) for n in views)
    assert same, "six-copy bytes differ"

    copies = CopyStream(device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def gemm() -> None:
        for _ in range(4):
            a @ a

    def misses() -> None:  # as CachedProvider._make_resident issues a layer's misses
        copies.begin()
        events = []
        for k in range(K):
            copies.copy(pool.raw_of(K + k), host_raw[k])
            events.append(copies.record(k))
        for event in events:
            copies.wait(event)

    def overlapped() -> None:
        copies.begin()
        events = []
        for k in range(K):
            copies.copy(pool.raw_of(K + k), host_raw[k])
            events.append(copies.record(k))
        gemm()  # the layer's hits, on the compute stream, while the misses cross the link
        for event in events:
            copies.wait(event)

    t_layer, t_gemm, t_both = _timed(misses, reps, device), _timed(gemm, reps, device), _timed(overlapped, reps,
                                                                                              device)
    src = pool.raw_of(2)

    def d2d() -> None:
        dst.copy_(src)

    t_d2d = _timed(d2d, reps, device)
    gb = nbytes / 1e9
    return {
        "device": torch.cuda.get_device_name(device), "expert_bytes": layout.payload, "slot_bytes": nbytes,
        "reps": reps,
        "one_copy_ms": t_one * 1e3, "one_copy_gbps": gb / t_one,
        "six_copies_ms": t_six * 1e3, "six_copies_gbps": gb / t_six,
        "layer_misses": K, "layer_copy_ms": t_layer * 1e3, "layer_gbps": K * gb / t_layer,
        "gemm_ms": t_gemm * 1e3, "overlapped_ms": t_both * 1e3,
        "hidden_fraction": max(0.0, min(1.0, (t_layer + t_gemm - t_both) / t_layer)),
        "d2d_ms": t_d2d * 1e3, "d2d_gbps": 2 * gb / t_d2d,  # read + write
    }


def dry_run() -> dict:
    """The same objects on the CPU: a pool, pinned-layout rows, one copy and six, the copy protocol recorded."""
    layout = expert_layout()
    pool = SlotPool(2, 1, 2, layout.shapes, "cpu")
    host_raw, host = layout.empty(1)
    host_raw.random_(0, 256)
    t0 = time.perf_counter()
    rec = RecordingStream()
    rec.begin()
    rec.copy(pool.raw_of(0), host_raw[0])
    rec.wait(rec.record(0), 0)
    t_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name, t in pool.views(1).items():
        t.copy_(host[name][0])
    t_six = time.perf_counter() - t0
    ok = torch.equal(pool.raw_of(0), host_raw[0]) and all(
        torch.equal(v.view(torch.uint8), host[n][0].view(torch.uint8)) for n, v in pool.views(1).items())
    gb = layout.nbytes / 1e9
    return {"device": "cpu (dry run)", "expert_bytes": layout.payload, "slot_bytes": layout.nbytes,
            "tensors": len(layout.shapes), "bytes_match": ok, "protocol": [list(map(str, e)) for e in rec.log],
            "one_copy_ms": t_one * 1e3, "one_copy_gbps": gb / t_one, "six_copies_ms": t_six * 1e3,
            "six_copies_gbps": gb / t_six}


def table(r: dict) -> str:
    rows = [f"expert: {r['expert_bytes']:,} bytes ({r['slot_bytes']:,} in its slot) on {r['device']}",
            f"{'copy':<34}{'ms':>9}{'GB/s':>9}",
            f"{'pinned -> slot, one copy':<34}{r['one_copy_ms']:>9.3f}{r['one_copy_gbps']:>9.2f}",
            f"{'pinned -> slot, six copies':<34}{r['six_copies_ms']:>9.3f}{r['six_copies_gbps']:>9.2f}"]
    if "layer_copy_ms" in r:
        rows += [f"{f'layer: {K} misses on the copy stream':<34}{r['layer_copy_ms']:>9.3f}{r['layer_gbps']:>9.2f}",
                 f"{'compute alone (4 bf16 GEMMs)':<34}{r['gemm_ms']:>9.3f}",
                 f"{'misses + compute, overlapped':<34}{r['overlapped_ms']:>9.3f}"
                 f"   ({r['hidden_fraction']:.0%} of the copy hidden)",
                 f"{'device -> device':<34}{r['d2d_ms']:>9.3f}{r['d2d_gbps']:>9.2f}",
                 f"one copy / six: {r['six_copies_ms'] / r['one_copy_ms']:.2f}x faster; "
                 f"a miss at {r['one_copy_gbps']:.1f} GB/s"]
    else:
        rows.append(f"bytes match: {r['bytes_match']}; protocol: {' '.join(e[0] for e in r['protocol'])}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--dry-run", action="store_true", help="build the objects on the CPU (no GPU needed)")
    args = p.parse_args(argv)
    if args.dry_run:
        result = dry_run()
    else:
        device = torch.device(args.device)
        if device.type != "cuda" or not torch.cuda.is_available():
            print("bench/gpu_transfer.py: needs a CUDA device (or --dry-run)", file=sys.stderr)
            return 2
        torch.cuda.set_device(device)
        result = measure(device, args.reps)
    print(json.dumps(result) if args.json else table(result))
    return 0 if result.get("bytes_match", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
