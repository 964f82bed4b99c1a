"""Train the demo Qwen3-MoE model on one CPU thread and save it as a HF directory.

  python train.py --steps N --minutes M --out ../../assets/demo-moe

* tokenizes the corpus once into /work/demo_build/data (uint16 .npy streams)
* AdamW, linear warmup + cosine decay to 10 %, seeded, grad-clip 1.0
* loss (LM + --aux-coef * load-balancing loss) logged to a CSV; the balancing loss is computed per
  layer and averaged (--balance per-layer, the default), or as transformers does it, over all layers'
  router logits pooled into one set (--balance pooled), where expert e of every layer counts as one
  expert and single layers may stay skewed or leave experts unused
* checkpoints (model + optimizer + step) to --ckpt-dir every --ckpt-minutes;
  --resume continues from the last one
* stops at --steps or when --minutes of wall clock have passed, whichever is
  first, and then always writes the final bf16 model directory
* continued training: --init-from DIR starts from a saved model directory (same shape flags; fresh
  optimizer and schedule), and --mix F draws a share F of every batch's windows from the corpus'
  finetune.jsonl (build_corpus.py: the core names in all five wordings and "I don't know" answers),
  the rest from the usual training stream, so the other domains and the routing losses stay in play
"""

import argparse
import csv
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

_THREADS = int(os.environ.get("DEMO_TRAIN_THREADS", "1"))
torch.set_num_threads(_THREADS)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:
    pass

from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

HERE = Path(__file__).resolve().parent
DOMAINS = ["code", "docs", "quotes", "arith", "chat"]


def model_config(vocab_size, eos_ids, pad_id, args):
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,  # unused: every layer is sparse
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=args.tie,
        attention_bias=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        moe_intermediate_size=args.moe_inter,
        num_experts_per_tok=args.topk,
        num_experts=args.experts,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        mlp_only_layers=[],
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        initializer_range=0.02,
    )


def tokenize_corpus(corpus: Path, tok_dir: Path, data: Path, chat_repeat: int, seed: int):
    """Token streams: train.npy (shuffled docs; chat docs repeated chat_repeat times, times a document's
    own "repeat" field where it has one), heldout_<domain>.npy."""
    data.mkdir(parents=True, exist_ok=True)
    stamp = data / "stamp.json"
    want = {"corpus_mtime": os.path.getmtime(corpus / "train.jsonl"),
            "tok_mtime": os.path.getmtime(tok_dir / "tokenizer.json"), "chat_repeat": chat_repeat, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")

    def load(split):
        with open(corpus / f"{split}.jsonl") as f:
            return [json.loads(l) for l in f]

    train = load("train")
    enc = tok.encode_batch([d["text"] for d in train])
    docs = []
    for d, e in zip(train, enc, strict=True):
        rep = (chat_repeat if d["domain"] == "chat" else 1) * int(d.get("repeat", 1))
        docs += [e.ids + [eot]] * rep
    random.Random(seed).shuffle(docs)
    np.save(data / "train.npy", np.fromiter((t for d in docs for t in d), dtype=np.uint16))
    held = load("heldout")
    enc = tok.encode_batch([d["text"] for d in held])
    for dom in DOMAINS:
        ids = [t for d, e in zip(held, enc, strict=True) if d["domain"] == dom for t in e.ids + [eot]]
        np.save(data / f"heldout_{dom}.npy", np.array(ids, dtype=np.uint16))
    stamp.write_text(json.dumps(want))


def tokenize_finetune(corpus: Path, tok_dir: Path, data: Path, seed: int) -> Path:
    """finetune.npy: finetune.jsonl's documents, each repeated its own "repeat" times, shuffled, joined."""
    out, stamp = data / "finetune.npy", data / "finetune_stamp.json"
    want = {"corpus_mtime": os.path.getmtime(corpus / "finetune.jsonl"),
            "tok_mtime": os.path.getmtime(tok_dir / "tokenizer.json"), "seed": seed}
    if out.exists() and stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    with open(corpus / "finetune.jsonl") as f:
        ft = [json.loads(l) for l in f]
    docs = []
    for d, e in zip(ft, tok.encode_batch([d["text"] for d in ft]), strict=True):
        docs += [e.ids + [eot]] * int(d.get("repeat", 1))
    random.Random(seed + 1).shuffle(docs)
    np.save(out, np.fromiter((t for d in docs for t in d), dtype=np.uint16))
    stamp.write_text(json.dumps(want))
    return out


def init_from(path: Path, cfg) -> Qwen3MoeForCausalLM:
    """A float32 model with the weights of a saved model directory, whose shape must be cfg's."""
    model = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "tie_word_embeddings")
    got = {k: getattr(model.config, k) for k in keys}
    want = {k: getattr(cfg, k) for k in keys}
    if got != want:
        raise SystemExit(f"--init-from {path}: its shape {got} differs from the flags' {want}: pass the same "
                         "--layers/--hidden/--experts/--topk/--moe-inter/--tie as that model was trained with")
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = cfg.router_aux_loss_coef
    return model


def balance_loss(router_logits, k: int):
    """Load-balancing loss of each layer (E * sum_e f_e * P_e, as transformers defines it for one set of
    logits: 2.0 at uniform top-2 routing), averaged over layers."""
    losses = []
    for g in router_logits:
        probs = torch.softmax(g.float(), dim=-1)
        top = torch.topk(probs, k, dim=-1).indices
        frac = torch.nn.functional.one_hot(top, probs.shape[-1]).float().mean(0)  # [k, E]
        losses.append(probs.shape[-1] * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def sequence_mi(router_logits, batch: int):
    """Mutual information between sequence and expert under the router's soft choices, per layer, averaged:
    H(mean routing of the batch) - mean over sequences of H(mean routing of the sequence), in nats.

    Maximising it (--mi-coef) asks each sequence to draw on few experts while the batch as a whole uses
    them all (the mutual-information loss of Mod-Squad, Chen et al. 2023, with sequences as the tasks):
    routing that stays with its experts along a document, and experts that differ between documents."""
    def entropy(p):
        return -(p * torch.log(p.clamp_min(1e-9))).sum(-1)
    mis = []
    for g in router_logits:
        probs = torch.softmax(g.float(), dim=-1).view(batch, -1, g.shape[-1])
        per_seq = probs.mean(1)
        mis.append(entropy(per_seq.mean(0)) - entropy(per_seq).mean())
    return torch.stack(mis).mean()


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def heldout_loss(model, data: Path, seq, max_seqs=None):
    model.eval()
    res = {}
    for dom in DOMAINS:
        ids = np.load(data / f"heldout_{dom}.npy").astype(np.int64)
        n = (len(ids) - 1) // seq
        if max_seqs:
            n = min(n, max_seqs)
        tot, cnt = 0.0, 0
        for i in range(0, n, 8):
            rows = [ids[j * seq:(j + 1) * seq + 1] for j in range(i, min(n, i + 8))]
            x = torch.tensor(np.stack(rows))
            out = model(input_ids=x[:, :-1], output_router_logits=False)
            lp = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]),
                                                   x[:, 1:].reshape(-1), reduction="sum")
            tot += lp.item()
            cnt += x[:, 1:].numel()
        res[dom] = tot / max(1, cnt)
    model.train()
    return res


def save_final(model, tok_dir: Path, out: Path, eos_ids, pad_id, meta):
    out.mkdir(parents=True, exist_ok=True)
    m = model.to(torch.bfloat16)
    m.config.dtype = torch.bfloat16
    m.config.output_router_logits = False  # training only: inference needs no router logits or aux loss
    m.generation_config = GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.05,
        max_new_tokens=128, eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None)
    m.save_pretrained(str(out), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tok_dir / f, out / f)
    # transformers 5 writes the expert count as "num_local_experts"; Hub Qwen3-MoE checkpoints
    # (and transformers 4.x) use "num_experts" and a top-level "rope_theta". Write those too, so
    # code reading config.json directly finds the usual keys; transformers 5 loads either form.
    cj = json.loads((out / "config.json").read_text())
    cj["num_experts"] = cj.pop("num_local_experts", cj.get("num_experts"))
    cj.setdefault("rope_theta", (cj.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    (out / "config.json").write_text(json.dumps(dict(sorted(cj.items())), indent=2) + "\n")
    for p in out.iterdir():
        p.chmod(0o644)
    (out / "training_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    model.to(torch.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="/work/demo_build/corpus")
    ap.add_argument("--tokenizer", default="/work/demo_build/tokenizer")
    ap.add_argument("--data", default="/work/demo_build/data")
    ap.add_argument("--ckpt-dir", default="/work/demo_build/ckpt")
    ap.add_argument("--out", default=str(HERE.parent.parent / "assets" / "demo-moe"))
    ap.add_argument("--log", default="/work/demo_build/train_log.csv")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--minutes", type=float, default=90.0, help="wall-clock budget; save and stop when reached")
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=128)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--experts-impl", default="eager", help="transformers experts kernel: eager|batched_mm|grouped_mm")
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--mi-coef", type=float, default=0.0,
                    help="weight of the sequence-expert mutual information bonus (see sequence_mi); 0 = off")
    ap.add_argument("--balance", choices=["per-layer", "pooled"], default="per-layer",
                    help="load-balancing loss per layer (averaged) or over all layers pooled (transformers)")
    ap.add_argument("--chat-repeat", type=int, default=3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export-only", action="store_true",
                    help="write --out from the last checkpoint in --ckpt-dir without training")
    ap.add_argument("--bench", type=int, default=0, help="only time this many steps, save nothing")
    ap.add_argument("--init-from", default=None,
                    help="start from the weights of this model directory (e.g. assets/demo-moe) instead of "
                         "a random initialisation; optimizer and schedule start afresh")
    ap.add_argument("--mix", type=float, default=0.0,
                    help="share of each batch's windows drawn from CORPUS/finetune.jsonl (0 = none)")
    args = ap.parse_args()
    t_start = time.time()

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok_dir, data = Path(args.tokenizer), Path(args.data)
    tokenize_corpus(Path(args.corpus), tok_dir, data, args.chat_repeat, args.seed)
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    eos_ids = [hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.convert_tokens_to_ids("<|endoftext|>")]
    pad_id = hf_tok.convert_tokens_to_ids("<|endoftext|>")

    cfg = model_config(len(hf_tok), eos_ids, pad_id, args)
    model = init_from(Path(args.init_from), cfg) if args.init_from else Qwen3MoeForCausalLM(cfg)
    if args.experts_impl != "eager":
        model.set_experts_implementation(args.experts_impl)
    model.float().train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params/1e6:.2f}M  (~{2*n_params/2**20:.1f} MiB bf16)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    train_ids = np.load(data / "train.npy", mmap_mode="r")
    n_chunks = (len(train_ids) - 1) // args.seq
    print(f"train tokens: {len(train_ids)}  chunks: {n_chunks}  tokens/step: {args.batch*args.seq}", flush=True)

    def order_for_epoch(ep):
        return np.random.default_rng(args.seed * 1000 + ep).permutation(n_chunks)

    n_mix = int(round(args.batch * args.mix))
    if not 0 <= n_mix <= args.batch:
        raise SystemExit(f"--mix {args.mix}: give a share between 0 and 1")
    n_main = args.batch - n_mix
    if n_mix:
        ft_ids = np.load(tokenize_finetune(Path(args.corpus), tok_dir, data, args.seed), mmap_mode="r")
        n_ft = (len(ft_ids) - 1) // args.seq
        print(f"finetune tokens: {len(ft_ids)}  chunks: {n_ft}  windows/step: {n_mix} of {args.batch}", flush=True)

    def batch_at(step):
        """Windows of step `step`: n_main from the training stream, n_mix from the finetune stream, each
        stream read in its own seeded per-epoch order."""
        rows = []
        if n_main:
            ep, within = divmod(step, n_chunks // n_main)
            idx = order_for_epoch(ep)[within * n_main:(within + 1) * n_main]
            rows = [train_ids[i * args.seq:(i + 1) * args.seq + 1] for i in idx]
        if n_mix:
            ep, within = divmod(step, n_ft // n_mix)
            fidx = np.random.default_rng(args.seed * 1000 + 500 + ep).permutation(n_ft)
            rows += [ft_ids[i * args.seq:(i + 1) * args.seq + 1] for i in fidx[within * n_mix:(within + 1) * n_mix]]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    step, ckpt = 0, Path(args.ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    if args.resume and (ckpt / "last.pt").exists():
        st = torch.load(ckpt / "last.pt", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        torch.set_rng_state(st["torch_rng"])
        print(f"resumed at step {step}", flush=True)

    if args.export_only:
        st = torch.load(ckpt / "last.pt", weights_only=False)
        model.load_state_dict(st["model"])
        meta = st.get("meta") or {"steps_done": st["step"], "args": st["args"]}
        save_final(model, tok_dir, Path(args.out), eos_ids, pad_id, meta)
        print(f"exported step {st['step']} to {args.out}", flush=True)
        return

    log_path = Path(args.log)
    new_log = not (args.resume and log_path.exists())
    logf = open(log_path, "w" if new_log else "a", newline="")
    logw = csv.writer(logf)
    if new_log:
        logw.writerow(["step", "elapsed_s", "lr", "loss", "lm_loss", "aux_loss", "tokens_seen", "heldout", "seq_mi"])

    def save_ckpt(meta=None):
        tmp = ckpt / "last.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "torch_rng": torch.get_rng_state(), "args": vars(args), "meta": meta}, tmp)
        os.replace(tmp, ckpt / "last.pt")

    last_ckpt = time.time()
    acc = {"loss": 0.0, "lm": 0.0, "aux": 0.0, "mi": 0.0, "n": 0}
    t_loop = time.time()
    stop_reason = "steps"
    while step < args.steps:
        if (time.time() - t_start) / 60 > args.minutes:
            stop_reason = "minutes"
            break
        x = batch_at(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        out = model(input_ids=x[:, :-1], output_router_logits=True)
        # next-token loss over the full window of seq+1 tokens (aux_loss comes from the router logits)
        lm = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]),
                                               x[:, 1:].reshape(-1))
        aux = out.aux_loss if args.balance == "pooled" else balance_loss(out.router_logits, args.topk)
        mi = sequence_mi(out.router_logits, x.shape[0])
        loss = lm + args.aux_coef * aux - args.mi_coef * mi
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        for key, value in (("loss", loss), ("lm", lm), ("aux", aux), ("mi", mi)):
            acc[key] += value.item()
        acc["n"] += 1
        if args.bench and step >= args.bench:
            dt = (time.time() - t_loop) / step
            print(f"bench: {dt:.3f} s/step, {args.batch*args.seq/dt:.0f} tok/s", flush=True)
            return
        held = ""
        if args.eval_every and step % args.eval_every == 0:
            h = heldout_loss(model, data, args.seq, max_seqs=16)
            held = json.dumps({k: round(v, 4) for k, v in h.items()})
        if step % args.log_every == 0 or held:
            n = max(1, acc["n"])
            logw.writerow([step, round(time.time() - t_start, 1), f"{lr_at(step - 1, args):.6g}",
                           round(acc["loss"] / n, 5), round(acc["lm"] / n, 5), round(acc["aux"] / n, 5),
                           step * args.batch * args.seq, held, round(acc["mi"] / n, 5)])
            logf.flush()
            el = time.time() - t_start
            print(f"step {step} loss {acc['lm']/n:.4f} aux {acc['aux']/n:.4f} mi {acc['mi']/n:.4f} "
                  f"{el/60:.1f} min {held}", flush=True)
            acc = {"loss": 0.0, "lm": 0.0, "aux": 0.0, "mi": 0.0, "n": 0}
        if (time.time() - last_ckpt) / 60 > args.ckpt_minutes:
            save_ckpt()
            last_ckpt = time.time()
    logf.close()
    meta = {"steps_done": step, "steps_planned": args.steps, "stop_reason": stop_reason,
            "tokens_seen": step * args.batch * args.seq, "train_tokens": int(len(train_ids)),
            "wall_minutes": round((time.time() - t_start) / 60, 1), "params": n_params,
            "args": vars(args), "threads": _THREADS, "torch": torch.__version__}
    save_ckpt(meta)
    save_final(model, tok_dir, Path(args.out), eos_ids, pad_id, meta)
    print(f"saved to {args.out} after {step} steps ({stop_reason})", flush=True)


if __name__ == "__main__":
    main()
