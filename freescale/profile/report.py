"""The bubble-profiling report of a run folder: report.json, report.html and PNG plots.

``write_report(run)`` reads ``<run>/profile/rank<r>.jsonl``, decomposes every step
(``bubbles.decompose``) and writes ``<run>/report/``:

- ``report.json``: ``summary`` (run means after warm-up), ``per_rank`` (per-step means in
  milliseconds) and ``rank_steps`` (every rank-step, seconds);
- ``gantt.png`` (per-rank phases over a window of steps), ``breakdown.png`` (where each
  rank's step time goes), ``straggler_hist.png`` (per-step straggler bubbles),
  ``compute_vs_workload.png`` (compute against the UIH tokens a rank trained);
- ``report.html``: all of it in one self-contained page.

``write_comparison(run_a, run_b)`` renders two runs side by side with B/A ratios.
"""

from __future__ import annotations

import base64
import html
import json
import os

import numpy as np

from freescale.io import write_text_atomic
from freescale.profile.bubbles import as_rows, blocked_by_span, decompose, summarize
from freescale.profile.mfu import mfu
from freescale.profile.peak import PEAK_FILE
from freescale.profile.timeline import read_timelines

REPORT_DIR = "report"
PHASE_COLORS = {
    "data": "#9e9e9e",
    "input_dist": "#8e44ad",
    "forward": "#2e86de",
    "backward": "#f39c12",
    "optimizer": "#27ae60",
    "injected_delay": "#e74c3c",
    "collision_wait": "#c0392b",
    "exclusive_wait": "#d35400",
    "flags_wait": "#7f8c8d",
    "id_wait": "#8e44ad",
    "vote": "#16a085",
}
PART_COLORS = {"compute": "#2e86de", "straggler bubble": "#e74c3c", "exposed comm": "#8e44ad", "data wait": "#9e9e9e"}


def analyze(run_dir: str, warmup_steps: int | None = None) -> dict:
    """The report's data for one run (no files written)."""
    metas, steps = read_timelines(run_dir)
    if warmup_steps is None:
        warmup_steps = _configured_warmup(run_dir)
    rank_steps = decompose(steps)
    if not rank_steps:
        raise ValueError(f"{run_dir}: the ranks' timelines share no complete step")
    result = summarize(rank_steps, warmup_steps)
    result["summary"].update(_embedding_measures(steps, result["summary"]))
    first, last = result["summary"]["first_step"], result["summary"]["last_step"]
    result["summary"]["blocked_ms_per_step_by_span"] = blocked_by_span(
        [rec for recs in steps.values() for rec in recs if first <= rec["step"] <= last])
    result["summary"].update(_efficiency(steps, rank_steps, result["summary"], run_dir))
    device_timed = any("device_compute" in rec for recs in steps.values() for rec in recs)
    result["summary"]["compute_from"] = "device events" if device_timed else "main-thread CPU"
    result["run_dir"] = run_dir
    result["ranks_meta"] = [metas.get(r, {}) for r in sorted(steps)]
    result["rank_steps"] = as_rows(rank_steps)
    result["_raw"] = steps
    return result


def write_report(run_dir: str, *, warmup_steps: int | None = None, gantt_steps: int = 6, out_dir: str | None = None) -> str:
    """Write the report folder of ``run_dir``; returns the path of report.json."""
    data = analyze(run_dir, warmup_steps)
    out = out_dir or os.path.join(run_dir, REPORT_DIR)
    os.makedirs(out, exist_ok=True)
    plots = {
        "gantt.png": _plot_gantt(data, gantt_steps),
        "breakdown.png": _plot_breakdown(data["per_rank"], _title(run_dir)),
        "straggler_hist.png": _plot_straggler_hist(data),
        "compute_vs_workload.png": _plot_compute_vs_workload(data),
    }
    for name, fig in plots.items():
        _save_fig(fig, os.path.join(out, name))
    write_text_atomic(os.path.join(out, "report.html"), _html_single(data, out, list(plots)))
    path = os.path.join(out, "report.json")
    write_text_atomic(path, json.dumps(_public(data), indent=2))
    return path


_WAITS = ("collision_wait", "exclusive_wait", "flags_wait", "id_wait")


_EXCHANGE_BYTES = ("exchange_bytes", "collision_bytes")


def _embedding_measures(steps: dict[int, list[dict]], summary: dict) -> dict:
    """Over the summarized steps, from the pipelines over FreeScale's own tables (nothing for the
    others): the collision rate and the waits (``prioritized``), and the bytes a rank's step
    exchanges with the others, mean over ranks and steps (``exchange_bytes_per_step``, both;
    ``collision_bytes_per_step``, ``prioritized``)."""
    first, last = summary["first_step"], summary["last_step"]
    records = [rec for recs in steps.values() for rec in recs if first <= rec["step"] <= last]
    out = {}
    if any("read_rows" in rec for rec in records):
        read = sum(rec.get("read_rows", 0) for rec in records)
        out["collision_rate"] = round(sum(rec.get("collision_rows", 0) for rec in records) / read, 6) if read else 0.0
        for kind in _WAITS:
            total = sum(t1 - t0 for rec in records for k, t0, t1 in rec["spans"] if k == kind)
            out[f"{kind}_ms_per_step"] = round(1000.0 * total / len(records), 3)
    for key in _EXCHANGE_BYTES:
        if any(key in rec for rec in records):
            out[f"{key}_per_step"] = round(sum(rec.get(key, 0) for rec in records) / len(records), 1)
    return out


def _efficiency(steps: dict[int, list[dict]], rank_steps: list, summary: dict, run_dir: str) -> dict:
    """Training FLOPs per sample over the summarized steps and, against the run's measured
    matmul peak (``freescale.profile.mfu``), model TFLOP/s and MFU: the FLOPs every rank trained
    over the ranks' summed step time times the per-rank peak (runs that counted FLOPs only)."""
    first, last = summary["first_step"], summary["last_step"]
    kept = {(s.rank, s.step): s.T for s in rank_steps if first <= s.step <= last}
    records = [rec for rank, recs in steps.items() for rec in recs if (rank, rec["step"]) in kept]
    if not any("train_flops" in rec for rec in records):
        return {}
    flops = float(sum(rec.get("train_flops", 0.0) for rec in records))
    samples = sum(rec.get("samples", 0) for rec in records)
    seconds = sum(kept.values()) / summary["ranks"]  # the steps' wall time, mean over ranks
    out = {"train_flop_per_sample": round(flops / samples, 1) if samples else 0.0,
           "model_tflops": round(flops / seconds / 1e12, 6) if seconds > 0 else 0.0}
    peak_path = os.path.join(run_dir, PEAK_FILE)
    if os.path.exists(peak_path):
        with open(peak_path) as f:
            peak = json.load(f)["flop_per_s"]
        out["peak_tflops_per_rank"] = round(peak / 1e12, 6)
        out["mfu_pct"] = round(100.0 * mfu(flops, seconds, peak, summary["ranks"]), 4)
    return out


def write_comparison(run_a: str, run_b: str, *, out_dir: str | None = None, warmup_steps: int | None = None) -> str:
    """Side-by-side report of two runs (B against A); returns the path of compare.json."""
    a, b = analyze(run_a, warmup_steps), analyze(run_b, warmup_steps)
    out = out_dir or os.path.join(run_b, REPORT_DIR, f"compare-{_title(run_a)}")
    os.makedirs(out, exist_ok=True)
    _save_fig(_plot_breakdown(a["per_rank"], f"A: {_title(run_a)}"), os.path.join(out, "breakdown_a.png"))
    _save_fig(_plot_breakdown(b["per_rank"], f"B: {_title(run_b)}"), os.path.join(out, "breakdown_b.png"))
    ratios = {k: _ratio(b["summary"][k], a["summary"][k]) for k in _COMPARED}
    comparison = {"a": _public(a), "b": _public(b), "ratio_b_over_a": ratios}
    write_text_atomic(os.path.join(out, "compare.html"), _html_compare(a, b, ratios, out))
    path = os.path.join(out, "compare.json")
    write_text_atomic(path, json.dumps(comparison, indent=2))
    return path


_COMPARED = ["step_ms", "compute_ms_per_step", "bubble_fraction", "straggler_pct", "straggler_bubble_ms_per_step",
             "exposed_comm_ms_per_step", "data_wait_ms_per_step"]


# Plots -------------------------------------------------------------------------------------


def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported when a report is drawn (once a run ends,
    on its rank 0), not by every rank that imports the trainer: about half a second of CPU each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_gantt(data: dict, window: int):
    plt = _pyplot()
    raw = data["_raw"]
    ranks = sorted(raw)
    common = sorted(set.intersection(*({r["step"] for r in raw[k]} for k in ranks)))
    shown = common[-window:]
    t0 = min(rec["start"] for k in ranks for rec in raw[k] if rec["step"] in shown)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(ranks)))
    for y, rank in enumerate(ranks):
        for rec in (r for r in raw[rank] if r["step"] in shown):
            ax.barh(y, 1000 * (rec["end"] - rec["start"]), left=1000 * (rec["start"] - t0), height=0.8,
                    color="#fdecea", edgecolor="#c0392b", linewidth=0.6)
            for kind, s, e in rec["spans"]:
                nested = kind in ("input_dist", "injected_delay", *_WAITS)
                ax.barh(y + (0.2 if nested else 0), 1000 * (e - s), left=1000 * (s - t0), height=0.35 if nested else 0.6,
                        color=PHASE_COLORS.get(kind, "#34495e"))
            ax.text(1000 * (rec["start"] - t0), y + 0.45, f"{rec['step']}", fontsize=7, va="bottom")
        for s in (s for s in data["rank_steps"] if s["rank"] == rank and s["step"] in shown and s["straggler"] > 0):
            compute_end = s["start"] + s["D"] + s["C"] + s["R"]
            ax.barh(y - 0.38, 1000 * s["straggler"], left=1000 * (compute_end - t0), height=0.12, color="#222222")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="#fdecea", edgecolor="#c0392b"))
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#222222"))
    labels = [*PHASE_COLORS, "step (waits sit inside the phases)", "straggler bubble (from own compute end)"]
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time since the window's first step (ms)")
    ax.set_title(f"Per-rank timeline, steps {shown[0]}-{shown[-1]} (numbers: step)")
    # The legend in a band of its own below the axis label (the plot keeps the rest).
    legend = fig.legend(handles, labels, ncol=4, fontsize=8, loc="lower center")
    fig.canvas.draw()
    band = legend.get_window_extent().height / fig.bbox.height + 0.02
    fig.tight_layout(rect=(0, band, 1, 1))
    return fig


def _plot_breakdown(per_rank: list[dict], title: str):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(per_rank) + 3), 4))
    ranks = [p["rank"] for p in per_rank]
    bottom = np.zeros(len(ranks))
    parts = {"compute": "compute_ms", "straggler bubble": "straggler_bubble_ms", "exposed comm": "exposed_comm_ms",
             "data wait": "data_wait_ms"}
    for label, key in parts.items():
        values = np.array([p[key] for p in per_rank])
        ax.bar([str(r) for r in ranks], values, bottom=bottom, label=label, color=PART_COLORS[label])
        bottom += values
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per step (mean after warm-up)")
    ax.set_title(f"Where each rank's step time goes\n{title}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def _kept(data: dict) -> list[dict]:
    warm = data["summary"]["warmup_steps"]
    return [s for s in data["rank_steps"] if s["step"] > warm] or data["rank_steps"]


def _plot_straggler_hist(data: dict):
    plt = _pyplot()
    rows = _kept(data)
    fig, ax = plt.subplots(figsize=(7, 4))
    values = {r: [1000 * s["straggler"] for s in rows if s["rank"] == r] for r in sorted({s["rank"] for s in rows})}
    top = max(max(v) for v in values.values())
    bins = np.linspace(0, max(top, 1.0), 30)
    for r, v in values.items():
        ax.hist(v, bins=bins, alpha=0.6, label=f"rank {r}")
    return _labelled(fig, ax, "straggler bubble per step (ms)", "steps", "Distribution of per-step straggler bubbles")


def _plot_compute_vs_workload(data: dict):
    plt = _pyplot()
    rows = _kept(data)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(sorted({s["rank"] for s in rows})):
        mine = [s for s in rows if s["rank"] == r]
        x = np.array([s["uih_tokens"] for s in mine], dtype=float)
        y = np.array([1000 * s["C"] for s in mine])
        color = f"C{i % 10}"
        label = f"rank {r}"
        if len(set(x)) > 1:
            slope, intercept = np.polyfit(x, y, 1)
            xs = np.linspace(x.min(), x.max(), 50)
            ax.plot(xs, slope * xs + intercept, "--", color=color, linewidth=1)
            label += f" ({slope * 1000:.1f} ms per 1k tokens)"
        ax.scatter(x, y, s=10, alpha=0.7, color=color, label=label)
    return _labelled(fig, ax, "workload: UIH tokens in the rank's batch", "own compute per step (ms)",
                     "Per-rank compute against per-rank workload")


def _labelled(fig, ax, xlabel: str, ylabel: str, title: str):
    """Axis labels, title and legend, laid out: the finish of the per-rank plots."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# HTML --------------------------------------------------------------------------------------

_SUMMARY_LABELS = {
    "step_ms": "step time (ms)",
    "compute_ms_per_step": "own compute (ms/step)",
    "bubble_fraction": "bubble fraction (T-C)/T",
    "bubble_fraction_p50": "bubble fraction p50",
    "bubble_fraction_p90": "bubble fraction p90",
    "bubble_fraction_max": "bubble fraction max",
    "straggler_pct": "straggler %",
    "straggler_bubble_ms_per_step": "straggler bubble (ms/step)",
    "straggler_bubble_ms_p50": "straggler bubble p50 (ms)",
    "straggler_bubble_ms_p90": "straggler bubble p90 (ms)",
    "straggler_bubble_ms_max": "straggler bubble max (ms)",
    "exposed_comm_ms_per_step": "exposed communication (ms/step)",
    "data_wait_ms_per_step": "data wait (ms/step)",
    "cpu_wait_ms_per_step": "waiting for a core (ms/step, within exposed communication)",
    "collision_rate": "collision rate (rows batch i+1 reads that batch i writes)",
    "collision_wait_ms_per_step": "collision rows and gradients wait (ms/step)",
    "exclusive_wait_ms_per_step": "exclusive rows and deferred gradients wait (ms/step)",
    "exchange_bytes_per_step": "embedding exchange with the other ranks (bytes/step per rank: ids, rows, gradients)",
    "collision_bytes_per_step": "of which the collision rows' gradients and rows (bytes/step per rank)",
    "train_flop_per_sample": "training FLOPs per sample (forward + backward, model FLOPs)",
    "model_tflops": "model TFLOP/s (all ranks)",
    "peak_tflops_per_rank": "measured matmul peak (TFLOP/s per rank)",
    "mfu_pct": "MFU % (model FLOP/s / (peak x ranks))",
    "steps": "steps (after warm-up)",
    "ranks": "ranks",
}
_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}.pair{display:flex;gap:1em}.pair img{width:49%}"""


def _img(path: str) -> str:
    with open(path, "rb") as f:
        return f'<img src="data:image/png;base64,{base64.b64encode(f.read()).decode()}">'


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.1f}"
    return str(v)


def _per_rank_table(per_rank: list[dict]) -> str:
    cols = ["rank", "step_ms", "compute_ms", "straggler_bubble_ms", "exposed_comm_ms", "cpu_wait_ms", "data_wait_ms",
            "bubble_fraction", "uih_tokens_per_step"]
    return _table(cols, [[p[c] for c in cols] for p in per_rank])


def _html_single(data: dict, out: str, images: list[str]) -> str:
    s = data["summary"]
    rows = [[label, s[key]] for key, label in _SUMMARY_LABELS.items() if key in s]
    body = [f"<h1>Bubble report: {html.escape(_title(data['run_dir']))}</h1>",
            f"<p>Steps {s['first_step']}-{s['last_step']} after {s['warmup_steps']} warm-up steps, {s['ranks']} ranks. "
            "Straggler bubble: time a rank waits for slower peers; exposed communication: the rest of its waiting, "
            "time it was ready to compute but waited for a core (a busy machine) included.</p>",
            _table(["measure", "value"], rows), "<h2>Per rank (ms per step)</h2>", _per_rank_table(data["per_rank"])]
    body += [f"<h2>{html.escape(name[:-4].replace('_', ' '))}</h2>{_img(os.path.join(out, name))}" for name in images]
    return _page(f"Bubble report: {_title(data['run_dir'])}", body)


def _html_compare(a: dict, b: dict, ratios: dict, out: str) -> str:
    rows = [[_SUMMARY_LABELS.get(k, k), a["summary"][k], b["summary"][k], ratios[k]] for k in _COMPARED]
    rows += [[_SUMMARY_LABELS[k], a["summary"].get(k, "-"), b["summary"].get(k, "-"), ""]
             for k in ("collision_rate", "train_flop_per_sample", "mfu_pct") if k in a["summary"] or k in b["summary"]]
    body = [f"<h1>Bubble comparison</h1><p>A: {html.escape(a['run_dir'])}<br>B: {html.escape(b['run_dir'])}</p>",
            _table(["measure", "A", "B", "B / A"], rows),
            "<h2>Per rank, A</h2>", _per_rank_table(a["per_rank"]), "<h2>Per rank, B</h2>", _per_rank_table(b["per_rank"]),
            f'<div class="pair">{_img(os.path.join(out, "breakdown_a.png"))}{_img(os.path.join(out, "breakdown_b.png"))}</div>']
    return _page("Bubble comparison", body)


def _page(title: str, body: list[str]) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>")


# Helpers -----------------------------------------------------------------------------------


def _public(data: dict) -> dict:
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _ratio(b: float, a: float):
    return round(b / a, 4) if a else None


def _title(run_dir: str) -> str:
    return os.path.basename(os.path.normpath(run_dir))


def _configured_warmup(run_dir: str) -> int:
    from freescale.config import ConfigError, load_config

    path = os.path.join(run_dir, "config.yaml")
    try:
        return load_config(path).profile.warmup_steps if os.path.exists(path) else 0
    except ConfigError:
        return 0


def _save_fig(fig, path: str) -> None:
    plt = _pyplot()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


