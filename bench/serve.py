"""What does the HTTP server cost? `moechat serve` driven by the official openai client vs the engine in-process.

    python bench/serve.py [MODEL_DIR (default assets/demo-moe)] [--tokens 256] [--rounds 5] [--clients 8]
                          [--requests 8] [--client-tokens 32] [-- extra moechat serve flags]

Starts `moechat serve` as a subprocess on a loopback port (tests/serveproc.py) and loads the same model
with the same defaults in this process, then measures, side by side:

* decode tok/s of one streamed greedy reply of --tokens tokens (end-of-turn off: `ignore_eos`), client side:
  (completion tokens - 1) / (last content event - first content event), with the openai client and with
  httpx + httpx-sse (the client of `moechat chat --remote`: no pydantic object per chunk, which on a 2-core
  machine takes CPU from the server); the engine's own figure for the direct run. Rounds alternate the three
  (ABCABC) so drift in the machine's speed cancels out; medians with min-max.
* time to first token of the same prompt: request sent -> first content event, vs prefill + first sample.
* --clients threads each sending --requests non-streamed requests of --client-tokens tokens, all at once:
  p50 / p99 / max of the per-request latency (queue wait included: one sequence at a time) and the
  aggregate tok/s, vs requests of the same size one after another on the engine, half of them before the
  server's block and half after (ABA).

The aim (issue 17): server decode >= 0.95 x the engine. The load average before and after is printed: on a
shared machine, read the spread before the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo-moe"
PROMPT = "Explain how apt works, step by step, in detail."


def _serveproc():
    spec = importlib.util.spec_from_file_location("serveproc", ROOT / "tests" / "serveproc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def server_decode(client, model: str, tokens: int) -> tuple[float, float]:
    """(decode tok/s, time to first token s) of one streamed reply, measured by the client."""
    t0 = time.perf_counter()
    first = last = None
    completion = 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    return (completion - 1) / (last - first), first - t0


def raw_decode(url: str, model: str, tokens: int) -> tuple[float, float]:
    """The same through httpx + httpx-sse (what `moechat chat --remote` uses): no pydantic model per chunk, so on a
    small machine the client takes less of the CPU the server needs."""
    import json

    import httpx
    from httpx_sse import EventSource

    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    completion = 0
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=600) as r:
        for event in EventSource(r).iter_sse():
            if event.data == "[DONE]":
                break
            data = json.loads(event.data)
            if data["choices"] and data["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
            if data.get("usage"):
                completion = data["usage"]["completion_tokens"]
    return (completion - 1) / (last - first), first - t0


def engine_decode(engine, tokens: int) -> tuple[float, float]:
    ids = engine.encode_chat([{"role": "user", "content": PROMPT}])
    sampling = engine.sampling(temperature=0)
    t0 = time.perf_counter()
    first = None
    last = None
    for chunk in engine.generate(ids, sampling=sampling, max_tokens=tokens, stop_on_eos=False):
        first = first or time.perf_counter()
        last = chunk
    return last.decode_tokens_per_s, first - t0


def many_clients(client, model: str, clients: int, requests: int, tokens: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        for j in range(requests):
            t = time.perf_counter()
            try:
                client.chat.completions.create(model=model, max_tokens=tokens, temperature=0,
                                               extra_body={"ignore_eos": True}, messages=[
                                                   {"role": "user", "content": f"Client {i}, question {j}: {PROMPT}"}])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return
            with lock:
                latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return latencies, clients * requests * tokens / (time.perf_counter() - t0)


def engine_sequential(engine, clients: int, requests: int, tokens: int) -> float:
    sampling = engine.sampling(temperature=0)
    t0 = time.perf_counter()
    for i in range(clients):
        for j in range(requests):
            ids = engine.encode_chat([{"role": "user", "content": f"Client {i}, question {j}: {PROMPT}"}])
            for _ in engine.generate(ids, sampling=sampling, max_tokens=tokens, stop_on_eos=False):
                pass
    return clients * requests * tokens / (time.perf_counter() - t0)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(DEMO))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--client-tokens", type=int, default=32)
    args, serve_flags = parser.parse_known_args()
    serve_flags = [f for f in serve_flags if f != "--"]

    import openai
    import torch

    from moechat.app.cli.engine_args import load_engine_from_args
    from moechat.app.cli.main import build_parser

    serveproc = _serveproc()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as cache, serveproc.ServeProcess(
            [*serve_flags, "--max-queue", str(args.clients * 2)], model=args.model, cache_dir=cache) as server:
        os.environ["XDG_CACHE_HOME"] = cache
        # the engine exactly as `moechat serve` builds it from the same flags
        ns = build_parser().parse_args(["serve", args.model, *serve_flags])
        engine = load_engine_from_args(ns)
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        print(f"model {model}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
              f"{os.cpu_count()} CPUs; load average {load0[0]:.2f} at start", file=sys.stderr)
        server_decode(client, model, 16)  # warm both paths (first-call allocations)
        engine_decode(engine, 16)
        s_rates, e_rates, s_ttft, e_ttft, h_rates, h_ttft = [], [], [], [], [], []
        for _ in range(args.rounds):  # ABCABC: openai client, httpx-sse client, engine
            r, t = server_decode(client, model, args.tokens)
            s_rates.append(r)
            s_ttft.append(t)
            r, t = raw_decode(server.base_url, model, args.tokens)
            h_rates.append(r)
            h_ttft.append(t)
            r, t = engine_decode(engine, args.tokens)
            e_rates.append(r)
            e_ttft.append(t)
        # ABA: the engine's half before and half after the server's block, so a change in load shows as a spread
        half = max(1, args.clients // 2)
        e_before = engine_sequential(engine, half, args.requests, args.client_tokens)
        latencies, s_total = many_clients(client, model, args.clients, args.requests, args.client_tokens)
        e_after = engine_sequential(engine, half, args.requests, args.client_tokens)
        e_total = (e_before + e_after) / 2
        alive = server.alive()
    load1 = os.getloadavg()
    ratio = statistics.median(s_rates) / statistics.median(e_rates)
    ratios = [s / e for s, e in zip(s_rates, e_rates, strict=True)]
    h_ratio = statistics.median(h_rates) / statistics.median(e_rates)
    h_ratios = [s / e for s, e in zip(h_rates, e_rates, strict=True)]
    rows = [
        ("what", "server (loopback)", "engine in-process", "ratio (per-round pairs)"),
        (f"decode tok/s, {args.tokens} tokens, openai client, median (min-max) of {args.rounds}",
         _spread(s_rates, ".1f"), _spread(e_rates, ".1f"), f"{ratio:.3f} ({min(ratios):.3f}-{max(ratios):.3f})"),
        ("  the same, httpx-sse client", _spread(h_rates, ".1f"), "",
         f"{h_ratio:.3f} ({min(h_ratios):.3f}-{max(h_ratios):.3f})"),
        ("time to first token, ms (openai / httpx-sse client)",
         f"{statistics.median(s_ttft) * 1e3:.1f} / {statistics.median(h_ttft) * 1e3:.1f}",
         _spread([t * 1e3 for t in e_ttft], ".1f"), f"{statistics.median(s_ttft) / statistics.median(e_ttft):.2f}"),
        (f"{args.clients} clients x {args.requests} requests x {args.client_tokens} tokens: latency p50 / p99 / max, s",
         f"{_pct(latencies, 0.5):.2f} / {_pct(latencies, 0.99):.2f} / {max(latencies):.2f}", "-", ""),
        ("  the same requests: aggregate tok/s", f"{s_total:.1f}",
         f"{e_total:.1f} ({e_before:.1f} before, {e_after:.1f} after; one after another)",
         f"{s_total / e_total:.3f}"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print(f"\nload average {load0[0]:.2f} -> {load1[0]:.2f} on {os.cpu_count()} CPUs"
          + ("  (the machine was busy: read the spread)" if max(load0[0], load1[0]) > 0.5 * (os.cpu_count() or 1)
             else "") + f"; server alive after the run: {alive}")
    best = max(ratio, h_ratio)
    print(f"aim: server decode >= 0.95 x engine: {'met' if best >= 0.95 else 'NOT met'} (openai client {ratio:.3f}, "
          f"httpx-sse client {h_ratio:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
