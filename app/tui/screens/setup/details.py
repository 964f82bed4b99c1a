"""The wizard's detail pane: what a highlighted row knows without another request (`brief_text`), and a picked
model's exact plan (`plan_texts`): the verdict from the safetensors headers, the memory plan's decisions with their
reasons, the expert formats, and what the download will do (cached files, partial files resumed, bytes to fetch).
"""

from __future__ import annotations

from moechat.engine.plan.catalog import MISSING_FEATURES

from .listing import PICK_HINT, _params, _Row, _size, catalog_estimate, format_lines, strip_repo


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
