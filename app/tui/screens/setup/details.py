"""The wizard's detail pane: what a highlighted row knows without another request (`brief_text`), and a picked
model's exact plan (`plan_texts`): the verdict from the safetensors headers, the memory plan's decisions with their
reasons, the expert formats, and what the download will do (cached files, partial files resumed, bytes to fetch).
A GGUF repo's quants (`quant_texts`): one line per quant, the marked one's plan beneath.
"""

from __future__ import annotations

from moechat.engine.plan.catalog import MISSING_FEATURES

from .listing import PICK_HINT, _params, _rate, _Row, _size, catalog_estimate, format_lines, strip_repo


def brief_text(r: _Row, offline: str | None, hardware) -> str:
    """What the row knows without another request: the catalog entry and its estimated verdict."""
    e, s = r.entry, r.status
    lines = [e.repo_id, f"{e.family} · {_params(e)} parameters" + (f" · experts in {e.format}"
                                                                    if e.format != "?" else "")]
    if e.features:
        lines.append("needs: " + ", ".join(e.features))
    if not e.supported:
        why = e.why_unsupported or r.search_note or MISSING_FEATURES.get(e.family, "")
        lines.append(f"not supported yet: {why}")
    if s is None:
        lines.append("checking the Hub…" if r.search_note is None else "")
    elif s.verdict is not None:
        lines.append(f"on this machine: {s.verdict.summary()} (estimate from config.json)")
    elif r.quants:
        offer = ", ".join(f"{q.name} {_size(q.size)}" for q in r.quants[:8]) + (", …" if len(r.quants) > 8 else "")
        lines.append(f"GGUF: {len(r.quants)} quant{'s' if len(r.quants) != 1 else ''} ({offer}). Enter reads each "
                     "one's header (no weights): its verdict and predicted speed here, and the one to take")
    elif offline and e.supported and r.search_note is None:
        word, note, _ = catalog_estimate(e, hardware)
        lines.append(f"{offline}. {word}: {note}; the predicted speed needs config.json from the Hub")
    elif s.error:
        lines.append(strip_repo(s.error, e.repo_id))
    if e.note and not any(e.note in line for line in lines):  # the estimate's note may carry it already
        lines.append(e.note)
    lines += ["", PICK_HINT]
    return "\n".join(x for x in lines if x is not None)


def plan_texts(verdict, download, local: str | None) -> tuple[str, str, str]:
    """(summary, decisions, download plan): the exact verdict of one model, the memory plan's decisions with
    their reasons, and what the download will do (or where the snapshot already is)."""
    spec, plan = verdict.spec, verdict.best_plan  # the plan in the recommended expert format
    head = {"fits": "FITS", "does not fit": "DOES NOT FIT", "unsupported": "NOT SUPPORTED YET"}[verdict.verdict]
    lines = [f"{verdict.repo_id}" + (f" at {verdict.sha[:12]}" if verdict.sha else "") + f" ({spec.model_type})"
             f": {head} on this machine"]
    if not verdict.supported:
        lines.append(f"moechat cannot run it yet: {verdict.why_unsupported}")
    d = plan.decode
    if d is not None:
        lines.append(f"predicted decode {d.low:.1f}-{d.high:.1f} tok/s (bound {d.bound:.1f} tok/s, set by "
                     f"{d.bound_by})")
    if plan.refusal is not None:
        lines.append(f"does not fit: {plan.refusal.message}")
    lines.append(f"{spec.num_layers} layers, {spec.num_moe_layers} MoE x {spec.num_experts} experts, top-"
                 f"{spec.top_k}; {spec.total_experts:,} experts = {_size(spec.all_experts_bytes)}"
                 f"; dense {_size(spec.dense_bytes)}")
    lines.append(f"{spec.expert_format_line()}; stored as {spec.expert_format}")
    lines.append(f"sizes from {verdict.source}" + (" (estimates)" if spec.estimated else " (exact)")
                 + f"; plan: {plan.expert_slots} of {plan.total_experts} experts in device slots, "
                 f"{plan.host_tier}, context {plan.context:,}")
    lines += format_lines(verdict)
    summary = "\n".join(lines)
    decisions = "\n".join(
        f"• {d.item}" + ("" if d.bytes is None else f" {_size(d.bytes)}")
        + ("" if d.where in ("", "-") else f" on {d.where}") + f": {d.reason}"
        for d in plan.decisions)
    if local is not None:
        tail = [f"downloaded: {local}", "Open in chat loads it."]
    elif download is not None:
        tail = download.describe()
    else:
        tail = []
    return summary, decisions, "\n".join(tail)


QUANT_KEYS_HINT = "[ and ] choose another quant; D downloads the marked one (▶) and opens the chat."


def _quant_speed(fit) -> str:
    if fit.tok_s is None:
        return ""
    low, high = (_rate(x) for x in fit.tok_s)
    return f"{low} tok/s" if low == high else f"{low}-{high} tok/s"


def quant_texts(repo_id: str, fits, chosen, recommended, done: bool) -> tuple[str, str, str]:
    """(summary, the chosen quant's plan, its download) for a GGUF repo: one line per quant (name, size, verdict,
    predicted decode tok/s), ▶ on the one D fetches, ★ on the recommended one (engine/plan/hub/gguf.py
    `recommend_quant`: the largest that runs with every expert on this machine's fastest tier)."""
    n = len(fits)
    lines = [f"{repo_id}: GGUF, {n} quant{'s' if n != 1 else ''}" + ("" if done else " (reading their headers…)")]
    name_w = max([len(f.name) for f in fits] + [4])
    size_w = max([len(_size(f.size)) for f in fits] + [4])
    word_w = max([len(f.word) for f in fits if f.checked and f.verdict is not None] + [len("does not fit")])
    for f in fits:
        mark = "▶" if chosen is not None and f.name == chosen.name else " "
        star = "  ★ recommended" if recommended is not None and f.name == recommended.name else ""
        speed = _quant_speed(f)
        lines.append(f"{mark} {f.name:<{name_w}}  {_size(f.size):>{size_w}}  {f.word:<{word_w}}  {speed:<15}{star}"
                     .rstrip())
    if done:
        lines.append("")
        if recommended is None:
            lines.append("none of them runs on this machine: no quant recommended")
        elif recommended.full:
            where = "VRAM" if recommended.verdict.best_plan.device != "cpu" else "RAM"
            lines.append(f"★ {recommended.name}: the largest quant that runs with every expert in {where}")
        else:
            lines.append(f"★ {recommended.name}: none runs with every expert on the fastest tier; this one is "
                         "predicted fastest")
        lines.append(QUANT_KEYS_HINT)
    summary = "\n".join(lines)
    if chosen is None or chosen.verdict is None:
        return summary, "", ""
    plan_summary, decisions, _ = plan_texts(chosen.verdict, None, None)
    verdict = chosen.verdict
    left = verdict.download_bytes - verdict.cached_bytes
    download = (f"{chosen.name}: downloaded; D opens the chat on it" if left <= 0 else
                f"D downloads {chosen.name} only: {_size(left)} (resumed where a partial file is kept)")
    return summary, f"{plan_summary}\n{decisions}", download
