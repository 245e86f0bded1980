"""`trainlift report`: a run's curves as matplotlib PNGs and one self-contained HTML page.

Pure apart from what the caller reads and writes: metrics rows and summaries in, figures, PNG bytes and
HTML text out. Restarts (a resume, a worker-group restart, an elastic resize) are marked on the x-axis:
each start of the training loop writes an `"event": "start"` row; for older files, a step that goes back
or a change of `world` between rows shows one too.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from typing import Any

from trainlift.errors import UsageError
from trainlift.rundir import eval_rows, train_rows

PLOTS = {  # file stem: (title, y label, [(row key, series label)])
    "loss": ("Loss", "loss", [("loss", "train"), ("eval_loss", "eval")]),
    "lr": ("Learning rate", "lr", [("lr", "lr")]),
    "tokens_per_s": ("Throughput", "tokens/s", [("tokens_per_s", "tokens/s")]),
    "mfu": ("Model FLOPs utilisation", "MFU", [("mfu", "MFU")]),
}
SUMMARY_KEYS = (("finished", "{}"), ("steps", "{}"), ("final_loss", "{:.4f}"), ("initial_eval_loss", "{:.4f}"),
                ("eval_loss", "{:.4f}"), ("tokens_per_s", "{:.0f}"), ("step_time_s", "{:.3f}"), ("mfu", "{:.1%}"),
                ("world_size", "{}"), ("device", "{}"), ("wall_time_s", "{:.1f}"), ("resumed_from", "{}"))


@dataclass
class Restart:
    step: int
    label: str


def restarts(rows: list[dict[str, Any]]) -> list[Restart]:
    """Where the run restarted: each start of the training loop after the first (its `world` and whether it
    went back past steps already trained tell a resize and a restart from a resume). Files written before
    start rows existed fall back to training rows whose step goes back or whose `world` changes."""
    marks, trained_through, world, started = [], 0, None, False
    has_starts = any(r.get("event") == "start" for r in rows)
    for row in rows:
        is_start = row.get("event") == "start"
        if has_starts and not is_start:
            trained_through = max(trained_through, row["step"]) if "loss" in row else trained_through
            continue
        if not has_starts and "loss" not in row:
            continue
        step = row["step"] if is_start else row["step"] - 1  # the step the loop (re)started from
        new_world = row.get("world")
        if started and world is not None and new_world is not None and new_world != world:
            marks.append(Restart(step, f"{world}→{new_world} workers at {step}"))
        elif started and step < trained_through:
            marks.append(Restart(step, f"restarted from {step}"))
        elif started and is_start:
            marks.append(Restart(step, f"resumed at {step}"))
        started, world = True, new_world if new_world is not None else world
        if not has_starts:
            trained_through = row["step"]
    return marks


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    source = eval_rows(rows) if key == "eval_loss" else train_rows(rows)
    points = [(r["step"], r[key]) for r in source if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def figures(runs: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """One matplotlib Figure per plot that has data, each run a line (several runs: `--compare`)."""
    from matplotlib.figure import Figure

    out = {}
    for stem, (title, ylabel, keys) in PLOTS.items():
        fig = Figure(figsize=(7, 3.4), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        drawn = False
        for i, (label, rows) in enumerate(runs):
            color = f"C{i}"
            for key, series in keys:
                steps, values = _series(rows, key)
                if not steps:
                    continue
                name = series if len(runs) == 1 else f"{label} {series}" if len(keys) > 1 else label
                style = {"marker": "o", "linestyle": "--"} if key == "eval_loss" else {}
                ax.plot(steps, values, color=color, label=name, linewidth=1.5, markersize=4, **style)
                drawn = True
            for mark in restarts(rows):
                ax.axvline(mark.step, color=color, linestyle=":", linewidth=1)
                ax.annotate(mark.label, (mark.step, 1), xycoords=("data", "axes fraction"), xytext=(-2, -4),
                            textcoords="offset points", rotation=90, va="top", ha="right", fontsize=7, color=color)
        if not drawn:
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out[stem] = fig
    return out


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "—"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def table_values(rows: list[dict[str, Any]], summary: dict[str, Any] | None) -> dict[str, Any]:
    """summary.json describes the last attempt; the eval before the first step comes from the rows, and the
    checkpoint resumed from is named relative to the run."""
    values = dict(summary or {})
    if values.get("initial_eval_loss") is None:
        values["initial_eval_loss"] = next((r["eval_loss"] for r in eval_rows(rows) if r["step"] == 0), None)
    if values.get("resumed_from"):
        values["resumed_from"] = str(values["resumed_from"]).rstrip("/").rsplit("/", 1)[-1]
    return values


def summary_table(runs: list[tuple[str, dict[str, Any] | None]]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for label, _ in runs)
    body = []
    for key, fmt in SUMMARY_KEYS:
        cells = "".join(f"<td>{html.escape(_cell((s or {}).get(key), fmt))}</td>" for _, s in runs)
        body.append(f"<tr><th>{key}</th>{cells}</tr>")
    return f"<table><tr><th></th>{head}</tr>{''.join(body)}</table>"


def restart_list(runs: list[tuple[str, list[dict[str, Any]]]]) -> str:
    items = [f"<li>{html.escape(label)}: {html.escape(m.label)}</li>" for label, rows in runs for m in restarts(rows)]
    return f"<h2>Restarts</h2><ul>{''.join(items)}</ul>" if items else ""


STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:12px 0}th,td{border:1px solid #ccc;padding:4px 10px;text-align:left}
img{display:block;max-width:100%;margin:8px 0;border:1px solid #eee}"""


def html_page(title: str, runs: list[tuple[str, list[dict[str, Any]], dict[str, Any] | None]],
              pngs: dict[str, bytes]) -> str:
    """One page, images embedded as data URIs: it can be mailed or opened anywhere."""
    images = "".join(
        f'<img alt="{stem}" src="data:image/png;base64,{base64.b64encode(data).decode()}">' for stem, data in pngs.items())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"{summary_table([(label, table_values(rows, summary)) for label, rows, summary in runs])}"
            f"{restart_list([(label, rows) for label, rows, _ in runs])}{images}</body></html>")


def build(runs: list[tuple[str, list[dict[str, Any]], dict[str, Any] | None]]) -> tuple[str, dict[str, bytes]]:
    """(HTML page, {plot name: PNG bytes}) for one run or several overlaid."""
    if not any(train_rows(rows) for _, rows, _ in runs):
        raise UsageError("no training steps in metrics.jsonl yet", hint="run a few steps first, then report")
    pngs = {stem: png_bytes(fig) for stem, fig in figures([(label, rows) for label, rows, _ in runs]).items()}
    title = "trainlift run " + " vs ".join(label for label, _, _ in runs)
    return html_page(title, runs, pngs), pngs
