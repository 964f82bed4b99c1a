"""Measure the shipped demo model with transformers and write the model-card numbers.

  python analyze.py --model ../../assets/demo-moe

Writes (into --model unless --out is given):
  loss_curve.png          training loss from the CSV log
  analysis.json           every number quoted in README.md
and prints a Markdown summary to stdout.

  python analyze.py --token-control-only

recomputes only the token-controlled domain dependence of routing (analysis.json's
"token_controlled": I(domain; expert | token) and the same-token JS divergence between
domains, each with a within-token label-shuffle noise floor) and merges it into the
existing analysis.json, leaving every other number and file as it is.

Everything is compared with a random-weight model of the same config
(Qwen3MoeForCausalLM(config) under torch.manual_seed(--seed), i.e. the
training script's initialisation).

Routing is read with a forward hook on every layer's `mlp.gate`
(Qwen3MoeTopKRouter, which returns logits, top-k weights, top-k indices).
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM  # noqa: E402

HERE = Path(__file__).resolve().parent
DOMAINS = ["code", "docs", "quotes", "arith", "chat"]

# (prompt, subject, kind): the subject is looked up in the training questions and
# in the source the corpus took its answers from (docstring, Jargon File, arithmetic)
PROMPTS = [
    ("What does json.dumps do?", "json.dumps", "doc"),
    ("What does str.split do?", "str.split", "doc"),
    ("What does os.path.join do?", "os.path.join", "doc"),
    ("What does collections.Counter do?", "collections.Counter", "doc"),
    ("What does json.dumps do in Python?", "json.dumps", "doc"),
    ("What does re.sub do in Python?", "re.sub", "doc"),
    ("What does textwrap.shorten do?", "textwrap.shorten", "doc"),
    ("What does len do?", "len", "doc"),
    ("What does math.sqrt do?", "math.sqrt", "doc"),
    ("Tell me what json.dumps does.", "json.dumps", "doc"),
    ("What does os.fizzle do?", "os.fizzle", "unknown"),
    ("What is 12 + 7?", "12 + 7", "arith"),
    ("What is 45 * 3?", "45 * 3", "arith"),
    ("What does \"hacker\" mean in hacker jargon?", "hacker", "jargon"),
]


def load_heldout(data: Path, seq: int, max_seqs: int):
    out = {}
    for dom in DOMAINS:
        ids = np.load(data / f"heldout_{dom}.npy").astype(np.int64)
        n = min((len(ids) - 1) // seq, max_seqs)
        out[dom] = torch.tensor(np.stack([ids[j * seq:(j + 1) * seq + 1] for j in range(n)]))
    return out


@torch.no_grad()
def run_domain(model, x, n_layers, bs=8):
    """Returns (mean NLL per token, list over layers of [n_seq, seq, k] expert indices)."""
    caught = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        def hook(mod, inp, outp, li=li):
            caught[li] = outp[2].detach()
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    nll, cnt = 0.0, 0
    idx = [[] for _ in range(n_layers)]
    try:
        for i in range(0, x.shape[0], bs):
            xb = x[i:i + bs]
            out = model(input_ids=xb[:, :-1])
            logits = out.logits.float()
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     xb[:, 1:].reshape(-1), reduction="sum").item()
            cnt += xb[:, 1:].numel()
            for li in range(n_layers):
                idx[li].append(caught[li].reshape(xb.shape[0], xb.shape[1] - 1, -1))
    finally:
        for h in hooks:
            h.remove()
    return nll / cnt, [torch.cat(t) for t in idx]


def js(p, q):
    m = 0.5 * (p + q)
    def kl(a, b):
        mask = a > 0
        return float(np.sum(a[mask] * np.log2(a[mask] / b[mask])))
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def routing_stats(idx_by_dom, n_exp, k):
    """idx_by_dom[dom][layer] -> LongTensor [n_seq, seq, k]."""
    L = len(next(iter(idx_by_dom.values())))
    usage = {}
    for dom, layers in idx_by_dom.items():
        u = np.zeros((L, n_exp))
        for li, t in enumerate(layers):
            u[li] = np.bincount(t.reshape(-1).numpy(), minlength=n_exp)
        usage[dom] = u / u.sum(1, keepdims=True)
    allu = sum(usage.values()) / len(usage)
    ent = -np.sum(np.where(allu > 0, allu * np.log2(np.where(allu > 0, allu, 1)), 0), axis=1)
    res = {
        "usage_per_domain": {d: np.round(u, 4).tolist() for d, u in usage.items()},
        # skew of the domain-averaged usage: entropy (bits, max log2 E) and top-expert share per layer
        "usage_entropy_bits": np.round(ent, 3).tolist(),
        "usage_entropy_max_bits": float(np.log2(n_exp)),
        "top_expert_share": np.round(allu.max(1), 4).tolist(),
        "uniform_share": 1.0 / n_exp,
    }
    # per-domain skew: mean over layers of the top-expert share and of the top-4 share
    res["per_domain_top1_share"] = {d: float(np.mean(u.max(1))) for d, u in usage.items()}
    res["per_domain_top4_share"] = {d: float(np.mean(np.sort(u, 1)[:, -4:].sum(1))) for d, u in usage.items()}
    doms = list(usage)
    mat = np.zeros((len(doms), len(doms)))
    for i, a in enumerate(doms):
        for j, b in enumerate(doms):
            mat[i, j] = np.mean([js(usage[a][l], usage[b][l]) for l in range(L)])
    res["js_matrix_bits"] = {"domains": doms, "matrix": np.round(mat, 4).tolist()}
    off = mat[np.triu_indices(len(doms), 1)]
    res["js_mean_offdiag_bits"] = float(off.mean())
    # temporal locality: token t reuses >=1 of token t-1's experts at the same layer
    reuse, overlap = [], []
    for dom, layers in idx_by_dom.items():
        for li, t in enumerate(layers):
            a, b = t[:, 1:, :], t[:, :-1, :]
            inter = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1).float()  # [n, s-1]
            reuse.append(((inter > 0).float().mean().item(), dom, li))
            overlap.append((inter.mean().item() / k, dom, li))
    res["reuse_any_mean"] = float(np.mean([r for r, _, _ in reuse]))
    res["reuse_any_per_domain"] = {d: float(np.mean([r for r, dd, _ in reuse if dd == d])) for d in doms}
    res["reuse_any_per_layer"] = [float(np.mean([r for r, _, l in reuse if l == li])) for li in range(L)]
    res["overlap_frac_mean"] = float(np.mean([o for o, _, _ in overlap]))
    # per-layer LRU expert cache simulated over each held-out sequence (cold start per sequence)
    res["lru_hit_rate"] = {}
    for cap in (4, 8):
        hits = tot = 0
        for layers in idx_by_dom.values():
            for t in layers:
                for seq in t.tolist():
                    cache = []
                    for experts in seq:
                        for e in experts:
                            tot += 1
                            if e in cache:
                                hits += 1
                                cache.remove(e)
                            elif len(cache) >= cap:
                                cache.pop(0)
                            cache.append(e)
        res["lru_hit_rate"][str(cap)] = hits / tot
    # independent uniform top-k choice: P(no shared expert) = C(E-k,k)/C(E,k)
    from math import comb
    res["reuse_any_uniform_baseline"] = 1 - comb(n_exp - k, k) / comb(n_exp, k)
    return res


def _entropy_bits(c, axis=-1):
    """Plug-in entropy (bits) of count arrays along axis; zero-count rows give 0."""
    n = c.sum(axis=axis, keepdims=True)
    p = np.divide(c, n, out=np.zeros(c.shape), where=n > 0)
    logp = np.log2(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis=axis)


def _js_rows(p, q):
    """Jensen-Shannon divergence (bits) between matching rows of p and q (probabilities)."""
    m = 0.5 * (p + q)
    def kl(a, b):
        r = np.divide(a, b, out=np.ones(a.shape), where=(a > 0) & (b > 0))
        return (a * np.log2(r)).sum(-1)
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def _tc_layer_stats(C, pairs):
    """Statistics of one layer from counts C[token, domain, expert] (expert slots, k per occurrence).

    Returns plug-in I(domain; expert | token) and I(domain; expert) in bits (occurrence-weighted over
    the selected tokens), H(expert | token), and the count-weighted JS divergence between the
    per-domain expert distributions of the same token, overall and per domain pair."""
    n_td = C.sum(-1)                              # [T, D] expert slots
    n_t = n_td.sum(-1)                            # [T]
    N = n_t.sum()
    h_e_t = _entropy_bits(C.sum(1))               # H(E | T=t)
    h_e_td = _entropy_bits(C)                     # H(E | T=t, D=d)
    p_d_t = n_td / n_t[:, None]
    cmi_t = h_e_t - (p_d_t * h_e_td).sum(-1)
    cmi = float((n_t * cmi_t).sum() / N)
    h_e_given_t = float((n_t * h_e_t).sum() / N)
    CD = C.sum(0)                                 # [D, E]: same occurrences, token ignored
    mi = float(_entropy_bits(CD.sum(0)) - (CD.sum(-1) / N * _entropy_bits(CD)).sum())
    P = C / np.maximum(n_td, 1)[..., None]
    js_num = js_den = 0.0
    per_pair = {}
    for a, b, toks in pairs:
        w = n_td[toks, a] + n_td[toks, b]
        j = _js_rows(P[toks, a], P[toks, b])
        per_pair[(a, b)] = float((w * j).sum() / w.sum())
        js_num += float((w * j).sum())
        js_den += float(w.sum())
    return {"cmi": cmi, "mi": mi, "h_e_given_t": h_e_given_t, "js": js_num / js_den, "js_pair": per_pair}


def token_controlled(x, idx_by_dom, n_exp, min_count=10, n_shuffle=100, seed=0, sweep=(5, 20)):
    """Domain dependence of routing with token identity held fixed.

    x[dom]: LongTensor [n_seq, seq+1] held-out windows; idx_by_dom[dom][layer]: [n_seq, seq, k] expert
    indices of the input positions x[:, :-1]. A (token id, domain) cell is used when the token occurs
    at least `min_count` times in that domain; a token is used when it has >= 2 such domains (only its
    occurrences in those domains count). Each occurrence contributes its k selected experts as k
    expert slots (the same unit as the usage distributions).

    Plug-in estimators are biased upwards on finite counts, so each statistic is also computed
    `n_shuffle` times with the domain labels permuted among the occurrences of the same token id
    (the same permutation for every layer: an occurrence keeps its routing at all layers). Under
    that null, routing does not depend on the domain beyond the token, so the shuffled values are the
    noise floor; "excess" = observed - mean(shuffled)."""
    doms = list(idx_by_dom)
    D = len(doms)
    L = len(next(iter(idx_by_dom.values())))
    tok = np.concatenate([x[d][:, :-1].reshape(-1).numpy() for d in doms])
    dom = np.concatenate([np.full(x[d][:, :-1].numel(), i) for i, d in enumerate(doms)])
    exp = [np.concatenate([idx_by_dom[d][li].reshape(-1, idx_by_dom[d][li].shape[-1]).numpy() for d in doms])
           for li in range(L)]
    k = exp[0].shape[1]
    V = int(tok.max()) + 1
    occ = np.zeros((V, D), dtype=np.int64)
    np.add.at(occ, (tok, dom), 1)

    def select(mc):
        ok = occ >= mc                                   # eligible (token, domain) cells
        tok_ok = ok.sum(1) >= 2
        keep = tok_ok[tok] & ok[tok, dom]
        return ok, tok_ok, keep

    def run(mc, shuffles, want_pairs):
        ok, tok_ok, keep = select(mc)
        t_ids = np.flatnonzero(tok_ok)
        remap = np.full(V, -1)
        remap[t_ids] = np.arange(len(t_ids))
        t = remap[tok[keep]]
        d = dom[keep]
        ex = [e[keep] for e in exp]
        T = len(t_ids)
        pairs = [(a, b, np.flatnonzero(ok[t_ids, a] & ok[t_ids, b])) for a in range(D) for b in range(a + 1, D)]
        pairs = [p for p in pairs if len(p[2])]

        def stats(dd):
            out = []
            for li in range(L):
                key = ((t[:, None] * D + dd[:, None]) * n_exp + ex[li]).reshape(-1)
                C = np.bincount(key, minlength=T * D * n_exp).reshape(T, D, n_exp).astype(np.float64)
                out.append(_tc_layer_stats(C, pairs))
            return out

        obs = stats(d)
        rng = np.random.default_rng(seed)
        order = np.argsort(t, kind="stable")             # occurrences grouped by token
        null = []
        for _ in range(shuffles):
            perm = order[np.lexsort((rng.random(len(t)), t[order]))]   # random order within each token
            dd = np.empty_like(d)
            dd[order] = d[perm]
            null.append(stats(dd))
        res = {"min_count": mc, "tokens": int(T), "occurrences": int(keep.sum()),
               "occurrence_share": float(keep.mean()),
               "occurrences_per_domain": {doms[i]: int((d == i).sum()) for i in range(D)},
               "tokens_per_domain_pair": {f"{doms[a]}-{doms[b]}": int(len(tt)) for a, b, tt in pairs}}
        for key in ("cmi", "js", "mi", "h_e_given_t"):
            o = np.array([s[key] for s in obs])
            res[key] = {"observed_per_layer": np.round(o, 5).tolist(), "observed_mean": float(o.mean())}
            if shuffles and key in ("cmi", "js"):
                nl = np.array([[s[key] for s in ns] for ns in null])        # [R, L]
                nm = nl.mean(1)
                res[key].update({
                    "shuffled_mean_per_layer": np.round(nl.mean(0), 5).tolist(),
                    "shuffled_sd_per_layer": np.round(nl.std(0), 5).tolist(),
                    "shuffled_mean": float(nm.mean()), "shuffled_sd": float(nm.std()),
                    "excess_per_layer": np.round(o - nl.mean(0), 5).tolist(),
                    "excess_mean": float(o.mean() - nm.mean()),
                    # one-sided permutation p-value of the layer mean (resolution 1/(R+1))
                    "p_value": float((1 + (nm >= o.mean()).sum()) / (shuffles + 1)),
                })
        if want_pairs:
            mat = {}
            for a, b, _ in pairs:
                o = float(np.mean([s["js_pair"][(a, b)] for s in obs]))
                nm = float(np.mean([[s["js_pair"][(a, b)] for s in ns] for ns in null])) if shuffles else float("nan")
                mat[f"{doms[a]}-{doms[b]}"] = {"observed": o, "shuffled": nm, "excess": o - nm}
            res["js_per_domain_pair"] = mat
        return res

    main = run(min_count, n_shuffle, True)
    main["sensitivity"] = {}
    for mc in sweep:
        r = run(mc, max(10, n_shuffle // 5), False)
        main["sensitivity"][str(mc)] = {"tokens": r["tokens"], "occurrence_share": r["occurrence_share"],
                                        "cmi_excess_mean": r["cmi"]["excess_mean"],
                                        "cmi_shuffled_mean": r["cmi"]["shuffled_mean"],
                                        "js_excess_mean": r["js"]["excess_mean"],
                                        "js_shuffled_mean": r["js"]["shuffled_mean"]}
    main["slots_per_occurrence"] = k
    main["n_shuffle"] = n_shuffle
    return main


def plot_loss(csv_path: Path, png: Path):
    import csv

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = list(csv.DictReader(open(csv_path)))
    steps = [int(r["step"]) for r in rows]
    lm = [float(r["lm_loss"]) for r in rows]
    hs, hv = [], []
    for r in rows:
        if r["heldout"]:
            h = json.loads(r["heldout"])
            hs.append(int(r["step"]))
            hv.append(float(np.mean(list(h.values()))))
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=90)
    ax.plot(steps, lm, lw=1, label="train LM loss (mean of 10 steps)")
    if hs:
        ax.plot(hs, hv, "o-", ms=3, lw=1, label="held-out loss (16 seqs/domain, mean of domains)")
    ax.set_xlabel("step (16 x 256 tokens)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(bottom=max(0, min(lm) - 0.5), top=min(9, max(lm) + 0.2))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    last = lm[-5:]
    return {"final_train_lm_loss_last50": float(np.mean(last)), "final_step": steps[-1]}


def plot_usage(result, png: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in ("trained", "random") if n in result]
    L = len(result[names[0]]["routing"]["usage_entropy_bits"])
    fig, axes = plt.subplots(len(names), L, figsize=(1.6 * L, 1.5 * len(names) + 0.4), dpi=80, squeeze=False)
    vmax = max(np.max(result[n]["routing"]["usage_per_domain"][d]) for n in names for d in DOMAINS)
    for r, n in enumerate(names):
        for li in range(L):
            m = np.array([result[n]["routing"]["usage_per_domain"][d][li] for d in DOMAINS])
            ax = axes[r, li]
            ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
            ax.set_xticks([])
            ax.set_yticks(range(len(DOMAINS)) if li == 0 else [])
            if li == 0:
                ax.set_yticklabels(DOMAINS, fontsize=7)
                ax.set_ylabel(n, fontsize=8)
            if r == 0:
                ax.set_title(f"layer {li}", fontsize=8)
    fig.suptitle("share of top-2 selections per expert (columns: 16 experts)", fontsize=8)
    fig.tight_layout()
    fig.savefig(png)


@torch.no_grad()
def layer0_mix(model, x, n=8):
    """RMS of layer 0's attention output over the RMS of the token embedding it is added to, on the first
    n windows of each domain: how much of the first router's input is not the token's own embedding."""
    caught = []
    h = model.model.layers[0].self_attn.register_forward_hook(lambda mod, inp, outp: caught.append(outp[0]))
    emb = attn = 0.0
    try:
        for dom in DOMAINS:
            xb = x[dom][:n, :-1]
            caught.clear()
            model(input_ids=xb)
            emb += model.model.embed_tokens(xb).pow(2).mean().item()
            attn += caught[0].pow(2).mean().item()
    finally:
        h.remove()
    return float(np.sqrt(attn / emb))


def tc_settings(args):
    return {"windows_per_domain": args.max_seqs, "seq": args.seq, "min_count": args.min_count,
            "shuffles": args.shuffles, "seed": args.seed, "unit": "expert slot (k per token occurrence)",
            "shuffle": "domain labels permuted among occurrences of the same token id, same permutation "
                       "for all layers"}


def token_control_only(args, result):
    """Routing of both models on the held-out windows -> result["token_controlled"] (nothing else changes).

    Checks first that the routing is the one the stored numbers came from (same JS divergence)."""
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cfg = model.config
    torch.manual_seed(args.seed)
    rand = Qwen3MoeForCausalLM(cfg).float().eval()
    x = load_heldout(Path(args.data), args.seq, args.max_seqs)
    tc = {"settings": tc_settings(args)}
    for name, m in [("trained", model), ("random", rand)]:
        idx = {dom: run_domain(m, x[dom], cfg.num_hidden_layers)[1] for dom in DOMAINS}
        js_now = routing_stats(idx, cfg.num_experts, cfg.num_experts_per_tok)["js_mean_offdiag_bits"]
        js_stored = result.get(name, {}).get("routing", {}).get("js_mean_offdiag_bits")
        print(f"{name}: domain JS {js_now:.4f} bits (stored: {js_stored})", file=sys.stderr, flush=True)
        if js_stored is not None and abs(js_now - js_stored) > 1e-3:
            print(f"warning: {name} routing differs from the one analysis.json was written from",
                  file=sys.stderr)
        tc[name] = token_controlled(x, idx, cfg.num_experts, args.min_count, args.shuffles, args.seed)
        tc[name]["layer0_attn_over_embedding_rms"] = layer0_mix(m, x)
    result["token_controlled"] = tc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(HERE.parent.parent / "assets" / "demo-moe"))
    ap.add_argument("--data", default="/work/demo_build/data")
    ap.add_argument("--corpus", default="/work/demo_build/corpus")
    ap.add_argument("--log", default="/work/demo_build/train_log.csv")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-seqs", type=int, default=48, help="held-out sequences per domain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-random", action="store_true")
    ap.add_argument("--min-count", type=int, default=10,
                    help="token-controlled routing: occurrences a token needs in a domain for that domain to count")
    ap.add_argument("--shuffles", type=int, default=100,
                    help="token-controlled routing: label shuffles for the noise floor")
    ap.add_argument("--token-control-only", action="store_true",
                    help="only (re)compute the token-controlled domain dependence of routing and merge it into "
                         "an existing analysis.json; leaves every other number and file alone")
    args = ap.parse_args()
    out = Path(args.out or args.model)
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    if args.token_control_only:
        result = json.loads((out / "analysis.json").read_text())
        token_control_only(args, result)
        (out / "analysis.json").write_text(json.dumps(result, indent=1) + "\n")
        print(markdown_token_controlled(result["token_controlled"]))
        return

    if Path(args.log).exists():
        result["train"] = plot_loss(Path(args.log), out / "loss_curve.png")

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cfg = model.config
    torch.manual_seed(args.seed)
    rand = Qwen3MoeForCausalLM(cfg).float().eval()

    x = load_heldout(Path(args.data), args.seq, args.max_seqs)
    result["heldout_tokens"] = {d: int(t[:, 1:].numel()) for d, t in x.items()}
    tc = {"settings": tc_settings(args)}
    for name, m in [("trained", model), ("random", rand)]:
        if name == "random" and args.skip_random:
            continue
        ppl, idx = {}, {}
        for dom in DOMAINS:
            nll, idx[dom] = run_domain(m, x[dom], cfg.num_hidden_layers)
            ppl[dom] = float(np.exp(nll))
            print(f"{name} {dom}: ppl {ppl[dom]:.2f}", file=sys.stderr, flush=True)
        result[name] = {"perplexity": ppl, "routing": routing_stats(idx, cfg.num_experts, cfg.num_experts_per_tok)}
        tc[name] = token_controlled(x, idx, cfg.num_experts, args.min_count, args.shuffles, args.seed)
        tc[name]["layer0_attn_over_embedding_rms"] = layer0_mix(m, x)
    result["token_controlled"] = tc

    # greedy chat transcripts
    train_q = {}
    for name in ("train.jsonl", "finetune.jsonl"):  # finetune.jsonl: the continued training (train.py --mix)
        if not (Path(args.corpus) / name).exists():
            continue
        with open(Path(args.corpus) / name) as f:
            for line in f:
                d = json.loads(line)
                if d["domain"] == "chat":
                    for q in d.get("questions", []):
                        train_q[q] = True
    import re
    sys.path.insert(0, str(HERE))
    import build_corpus
    docs = {q: a for q, _, a in build_corpus.docstring_pairs()}
    docs.update(build_corpus.core_pairs())  # the core set's answers are shorter (CORE_MAX_CHARS)
    jargon = {t: build_corpus.first_sentences(re.sub(r"^\[[^\]]*\]\s*", "", d.replace("\n", " ")), 300)
              for t, _, d in build_corpus.jargon_entries()}
    forms = {"doc": build_corpus.QUESTION_FORMS + build_corpus.MODULE_FORMS + [build_corpus.UNSEEN_FORM],
             "unknown": build_corpus.QUESTION_FORMS + [build_corpus.UNSEEN_FORM],
             "jargon": build_corpus.JARGON_FORMS, "arith": build_corpus.ARITH_FORMS}
    subjects, reference = {}, {}
    for p, subj, kind in PROMPTS:
        variants = {f.format(n=subj, e=subj) for f in forms[kind]}
        subjects[p] = sorted(variants & set(train_q))
        if kind == "doc":
            reference[p] = docs.get(subj)
        elif kind == "jargon":
            reference[p] = jargon.get(subj)
        elif kind == "unknown":
            reference[p] = build_corpus.DONTKNOW.format(n=subj)
        else:
            reference[p] = f"{subj} = {eval(subj)}"
    core = set(build_corpus.CORE_NAMES)
    transcripts = []
    for p, subj, _ in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, do_sample=False, max_new_tokens=60,
                                 eos_token_id=model.generation_config.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        new = gen[0, ids["input_ids"].shape[1]:]
        text = tok.decode(new, skip_special_tokens=False)
        transcripts.append({"user": p, "assistant": text, "core_name": subj in core,
                            "stopped_at_im_end": bool((new == tok.convert_tokens_to_ids("<|im_end|>")).any()),
                            "exact_question_in_train": p in train_q,
                            "same_subject_questions_in_train": subjects[p][:3],
                            "n_same_subject_questions_in_train": len(subjects[p]),
                            "reference_from_source": reference[p]})
        print(f"USER: {p}\nASSISTANT: {text}\n", file=sys.stderr, flush=True)
    result["transcripts"] = transcripts
    result["chat_eval"] = chat_eval(model, tok, Path(args.corpus), build_corpus)
    plot_usage(result, out / "routing_usage.png")
    (out / "analysis.json").write_text(json.dumps(result, indent=1) + "\n")

    print(markdown(result))
    print(markdown_token_controlled(result["token_controlled"]))
    print(markdown_chat_eval(result["chat_eval"]))


WORD = __import__("re").compile(r"[a-z0-9_]+")


def word_f1(reply: str, ref: str) -> float:
    """Bag-of-words F1 between a reply and a reference (lower-cased words)."""
    from collections import Counter
    a, b = Counter(WORD.findall(reply.lower())), Counter(WORD.findall(ref.lower()))
    common = sum((a & b).values())
    if not common:
        return 0.0
    prec, rec = common / sum(a.values()), common / sum(b.values())
    return 2 * prec * rec / (prec + rec)


@torch.no_grad()
def greedy_replies(model, tok, questions, max_new=48, bs=32):
    """Greedy replies (text up to <|im_end|>) to single-turn questions, batched with left padding."""
    tok.padding_side = "left"
    out = []
    for i in range(0, len(questions), bs):
        batch = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=False) for q in questions[i:i + bs]]
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new, repetition_penalty=1.0,
                             output_router_logits=False, eos_token_id=model.generation_config.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1]:]:
            out.append(tok.decode(row, skip_special_tokens=False).split("<|im_end|>")[0].split("<|endoftext|>")[0])
    return out


def chat_eval(model, tok, corpus: Path, build_corpus):
    """How often the model's answer to "What does X do?" is X's docstring answer, over whole sets of names,
    and how often it says it does not know.

    Sets: the core names asked in a training wording and in build_corpus.UNSEEN_FORM, a wording no
    training document uses; non-core names whose (only) question is in the training split; names whose
    question is only in the held-out split; names no chat question is about (build_corpus.unknown_names,
    the evaluated quarter: real stdlib names and made-up ones), whose source answer is "I don't know".
    Scores: exact match with the source answer; bag-of-words F1 against the name's own answer vs against
    another name's answer of the same set (a fixed derangement): the gap is how much of the reply is
    about *this* name rather than docstring boilerplate; and the share of replies that begin
    "I don't know" (dont_know)."""
    import random
    core = dict(build_corpus.core_pairs())
    split_q = {"train": {}, "heldout": {}}
    for split in split_q:
        with open(corpus / f"{split}.jsonl") as f:
            for line in f:
                d = json.loads(line)
                if d["domain"] != "chat" or d.get("core"):
                    continue
                for q in d.get("questions", []):
                    split_q[split][q] = True
    docs = {q: a for q, _, a in build_corpus.docstring_pairs()}
    forms = build_corpus.QUESTION_FORMS

    def subject(q):
        for f in forms:
            pre, post = f.split("{n}")
            if q.startswith(pre) and q.endswith(post):
                return q[len(pre):len(q) - len(post)]
        return None

    unseen = build_corpus.UNSEEN_FORM
    sets = {"core, training wording": [(forms[0].format(n=n), a) for n, a in core.items()],
            "core, wording not trained for it": [(unseen.format(n=n), a) for n, a in core.items()]}
    for split, label in (("train", "other names, question in training data"),
                         ("heldout", "other names, question only in held-out data")):
        items = sorted((q, docs[subject(q)]) for q in split_q[split] if subject(q) in docs)
        random.Random(0).shuffle(items)
        sets[label] = items[:120]
    evaluated = build_corpus.unknown_names()[1]
    for kind in ("real", "made-up"):
        sets[f"names no question is about, {kind}"] = [
            (forms[0].format(n=n), build_corpus.DONTKNOW.format(n=n)) for n, k in evaluated if k == kind]
    res = {}
    for label, items in sets.items():
        replies = greedy_replies(model, tok, [q for q, _ in items])
        refs = [a for _, a in items]
        shift = refs[1:] + refs[:1]
        exact = [r.strip() == a.strip() for r, a in zip(replies, refs, strict=True)]
        own = [word_f1(r, a) for r, a in zip(replies, refs, strict=True)]
        other = [word_f1(r, a) for r, a in zip(replies, shift, strict=True)]
        dont = [r.strip().startswith("I don't know") for r in replies]
        res[label] = {"n": len(items), "exact_match": float(np.mean(exact)), "f1_own": float(np.mean(own)),
                      "f1_other": float(np.mean(other)), "dont_know": float(np.mean(dont)),
                      "examples": [{"q": q, "reply": r, "source": a}
                                   for (q, a), r in list(zip(items, replies, strict=True))[:5]]}
        print(f"chat eval {label}: n={len(items)} exact {np.mean(exact):.3f} F1 own {np.mean(own):.3f} "
              f"other {np.mean(other):.3f} don't know {np.mean(dont):.3f}", file=sys.stderr, flush=True)
    return res


def markdown_chat_eval(ce):
    lines = ["| question set | names | exact match | word F1 vs own answer | word F1 vs another name's answer "
             "| \"I don't know\" |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, r in ce.items():
        dont = f"{r['dont_know']:.1%}" if "dont_know" in r else "-"  # analyses written before it was scored
        lines.append(f"| {label} | {r['n']} | {r['exact_match']:.1%} | {r['f1_own']:.3f} | {r['f1_other']:.3f} "
                     f"| {dont} |")
    return "\n".join(lines)


def markdown_token_controlled(tc):
    """Markdown tables of the token-controlled domain dependence (trained vs random-weight)."""
    T, R = tc["trained"], tc.get("random")
    def pair(f, fmt="{:.3f}"):
        return f"{fmt.format(f(T))} | " + (fmt.format(f(R)) if R else "-")
    def floor(key):
        return lambda r: f"{r[key]['shuffled_mean']:.3f} ± {r[key]['shuffled_sd']:.4f}"
    lines = ["#### Domain dependence with the token held fixed", "",
             f"Tokens occurring >= {T['min_count']} times in at least two domains: {T['tokens']} token ids, "
             f"{T['occurrences']:,} occurrences ({100 * T['occurrence_share']:.1f} % of the held-out positions); "
             f"noise floor from {T['n_shuffle']} within-token label shuffles.", "",
             "| statistic (bits, mean over 6 layers) | trained | random-weight |", "| --- | ---: | ---: |",
             "| I(domain; expert \\| token), observed | " + pair(lambda r: r["cmi"]["observed_mean"]) + " |",
             "| same, domain labels shuffled within each token (mean ± sd) | " + pair(floor("cmi"), "{}") + " |",
             "| **excess over the shuffled floor** | " + pair(lambda r: r["cmi"]["excess_mean"], "**{:.3f}**") + " |",
             "| JS between domains of the same token's expert distribution, observed | "
             + pair(lambda r: r["js"]["observed_mean"]) + " |",
             "| same, domain labels shuffled within each token (mean ± sd) | " + pair(floor("js"), "{}") + " |",
             "| **excess over the shuffled floor** | " + pair(lambda r: r["js"]["excess_mean"], "**{:.3f}**") + " |",
             "| H(expert \\| token): routing entropy left once the token is known (of 4) | "
             + pair(lambda r: r["h_e_given_t"]["observed_mean"], "{:.2f}") + " |",
             "| excess I(domain; expert \\| token) / H(expert \\| token) | "
             + pair(lambda r: 100 * r["cmi"]["excess_mean"] / r["h_e_given_t"]["observed_mean"], "{:.1f} %") + " |",
             "| I(domain; expert), same occurrences, token ignored (plug-in) | "
             + pair(lambda r: r["mi"]["observed_mean"]) + " |"]
    for mc, v in T["sensitivity"].items():
        rv = R["sensitivity"][mc] if R else None
        lines.append(f"| excess I(domain; expert \\| token) with threshold {mc} ({v['tokens']} tokens, "
                     f"{100 * v['occurrence_share']:.0f} % of positions) | {v['cmi_excess_mean']:.3f} | "
                     + (f"{rv['cmi_excess_mean']:.3f}" if rv else "-") + " |")
    lines += ["", "| layer | excess I(domain; expert \\| token) (trained / random) "
              "| excess same-token JS (trained / random) | H(expert \\| token) (trained / random) |",
              "| ---: | ---: | ---: | ---: |"]
    for li in range(len(T["cmi"]["excess_per_layer"])):
        def lp(key, sub, fmt="{:.3f}", li=li):
            a = T[key][sub][li]
            return fmt.format(a) + " / " + (fmt.format(R[key][sub][li]) if R else "-")
        lines.append(f"| {li} | {lp('cmi', 'excess_per_layer')} | {lp('js', 'excess_per_layer')} "
                     f"| {lp('h_e_given_t', 'observed_per_layer', '{:.2f}')} |")
    lines += ["", "| domain pair | shared tokens | excess same-token JS, trained | random-weight |",
              "| --- | ---: | ---: | ---: |"]
    for k, v in T["js_per_domain_pair"].items():
        rv = R["js_per_domain_pair"][k]["excess"] if R else float("nan")
        lines.append(f"| {k} | {T['tokens_per_domain_pair'][k]} | {v['excess']:.3f} | {rv:.3f} |")
    return "\n".join(lines)


def markdown(result):
    """Markdown tables for the model card."""
    T = result["trained"]
    R = result.get("random")
    lines = ["#### Held-out perplexity", "",
             "| domain | held-out tokens | trained | random-weight |", "| --- | ---: | ---: | ---: |"]
    for d in DOMAINS:
        rp = f"{R['perplexity'][d]:.0f}" if R else "-"
        lines.append(f"| {d} | {result['heldout_tokens'][d]:,} | {T['perplexity'][d]:.2f} | {rp} |")
    tr, rr = T["routing"], (R["routing"] if R else None)
    L = len(tr["usage_entropy_bits"])
    lines += ["", "#### Routing per layer (all held-out domains pooled)", "",
              "| layer | top-1 expert share (trained / random) | usage entropy, bits of 4 (trained / random) "
              "| P(reuse >=1 of previous token's experts) (trained / random) |",
              "| ---: | ---: | ---: | ---: |"]
    for li in range(L):
        def pair(key, li=li):
            a = tr[key][li]
            b = rr[key][li] if rr else float("nan")
            return f"{a:.3f} / {b:.3f}"
        lines.append(f"| {li} | {pair('top_expert_share')} | {pair('usage_entropy_bits')} "
                     f"| {pair('reuse_any_per_layer')} |")
    def row(name, f):
        return f"| {name} | {f(tr)} | {f(rr) if rr else '-'} |"
    lines += ["", "#### Summary", "", "| statistic | trained | random-weight |", "| --- | ---: | ---: |",
              row("mean top-1 expert share per layer (uniform = 0.0625)",
                  lambda r: f"{np.mean(r['top_expert_share']):.3f}"),
              row("mean usage entropy per layer, bits (uniform = 4)",
                  lambda r: f"{np.mean(r['usage_entropy_bits']):.2f}"),
              row("mean Jensen-Shannon divergence between domains, bits", lambda r: f"{r['js_mean_offdiag_bits']:.3f}"),
              row("P(token reuses >=1 of previous token's experts), same layer",
                  lambda r: f"{r['reuse_any_mean']:.3f}"),
              row("mean overlap fraction with previous token's experts", lambda r: f"{r['overlap_frac_mean']:.3f}"),
              row("LRU hit rate, 4 of 16 experts cached per layer", lambda r: f"{r['lru_hit_rate']['4']:.3f}"),
              row("LRU hit rate, 8 of 16 experts cached per layer", lambda r: f"{r['lru_hit_rate']['8']:.3f}"),
              f"| independent uniform top-2 baseline for reuse | {tr['reuse_any_uniform_baseline']:.3f} | |"]
    for name, r in (("trained", tr), ("random-weight", rr)):
        if not r:
            continue
        doms, m = r["js_matrix_bits"]["domains"], r["js_matrix_bits"]["matrix"]
        lines += ["", f"#### Jensen-Shannon divergence between domains, {name} (bits, mean over layers)", "",
                  "| | " + " | ".join(doms) + " |", "| --- |" + " ---: |" * len(doms)]
        for i, d in enumerate(doms):
            lines.append(f"| {d} | " + " | ".join(f"{v:.3f}" for v in m[i]) + " |")
    lines += ["", "#### Per-domain concentration (trained / random): "
              "mean over layers of the top-1 and top-4 expert shares", "",
              "| domain | top-1 share | top-4 share | reuse prob. |", "| --- | ---: | ---: | ---: |"]
    for d in DOMAINS:
        lines.append(f"| {d} | {tr['per_domain_top1_share'][d]:.3f} / {rr['per_domain_top1_share'][d]:.3f} | "
                     f"{tr['per_domain_top4_share'][d]:.3f} / {rr['per_domain_top4_share'][d]:.3f} | "
                     f"{tr['reuse_any_per_domain'][d]:.3f} / {rr['reuse_any_per_domain'][d]:.3f} |" if rr else
                     f"| {d} | {tr['per_domain_top1_share'][d]:.3f} | {tr['per_domain_top4_share'][d]:.3f} "
                     f"| {tr['reuse_any_per_domain'][d]:.3f} |")
    lines += ["", "#### Greedy transcripts", ""]
    for t in result["transcripts"]:
        lines += ["```", f"user: {t['user']}", f"assistant: {t['assistant']}", "```",
                  f"Stopped with `<|im_end|>`: {t['stopped_at_im_end']}. Exact question in training data: "
                  f"{t['exact_question_in_train']}. Core name: {t.get('core_name', False)}. "
                  f"Training questions on the same subject: "
                  f"{t['n_same_subject_questions_in_train']} {t['same_subject_questions_in_train']}. "
                  f"Source text: {t['reference_from_source']!r}", ""]
    return "\n".join(lines)

if __name__ == "__main__":
    main()
