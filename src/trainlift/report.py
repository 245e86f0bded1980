"""`trainlift report`: a run's curves as matplotlib PNGs and one self-contained HTML page.

Pure apart from what the caller reads and writes: metrics rows and summaries in, figures, PNG bytes and
HTML text out. Restarts (a resume, a worker-group restart, an elastic resize) are marked on the x-axis:
each start of the training loop writes an `"event": "start"` row; for older files, a step that goes back
or a change of `world` between rows shows one too. A DPO run (`train.objective: dpo`) also gets its rewards and reward
accuracy, as plots and summary cells; a run without them (SFT) gets neither.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from typing import Any

from trainlift.errors import UsageError
from trainlift.rundir import eval_rows, train_rows

PLOTS = {  # file stem: (title, y label, [(row key, series label)]); eval_* keys come from the eval rows
    "loss": ("Loss", "loss", [("loss", "train"), ("eval_loss", "eval")]),
    "rewards": ("DPO rewards", "β · log-prob gain over the reference",
                [("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"), ("rewards/margin", "margin")]),
    "reward_accuracy": ("DPO reward accuracy", "pairs with chosen reward above rejected",
                        [("rewards/accuracy", "train"), ("eval_rewards/accuracy", "eval")]),
    "lr": ("Learning rate", "lr", [("lr", "lr")]),
    "tokens_per_s": ("Throughput", "tokens/s", [("tokens_per_s", "tokens/s")]),
    "mfu": ("FLOPs utilisation", "of peak", [("mfu", "MFU (model FLOPs)"), ("hfu", "HFU (recompute included)")]),
}
COLOUR_PER_SERIES = {"rewards"}  # plots whose series are curves of their own, not a train and an eval view of one
SERIES_LINE_STYLES = ("-", "--", ":")  # what tells those series apart when the colour is the run's (--compare)
Y_LIMITS = {"reward_accuracy": (-0.03, 1.03)}
SUMMARY_KEYS = (("finished", "{}"), ("steps", "{}"), ("final_loss", "{:.4f}"), ("initial_eval_loss", "{:.4f}"),
                ("eval_loss", "{:.4f}"), ("tokens_per_s", "{:.0f}"), ("step_time_s", "{:.3f}"), ("mfu", "{:.1%}"),
                ("hfu", "{:.1%}"), ("world_size", "{}"), ("device", "{}"), ("wall_time_s", "{:.1f}"), ("resumed_from", "{}"))
# After eval_loss, when a run has them: the last step's rewards (from metrics.jsonl) and the last evaluation's.
DPO_SUMMARY_KEYS = (("final_rewards/accuracy", "{:.1%}"), ("final_rewards/margin", "{:.3f}"),
                    ("eval_rewards/accuracy", "{:.1%}"), ("eval_rewards/margin", "{:.3f}"))


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
    source = eval_rows(rows) if key.startswith("eval_") else train_rows(rows)
    points = [(r["step"], r[key]) for r in source if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _line_style(stem: str, key: str, run: int, series: int, runs: int) -> dict[str, Any]:
    """Each run its colour, eval series dashed with markers; in a COLOUR_PER_SERIES plot each series its own colour
    (one run) or line style (several runs)."""
    if stem in COLOUR_PER_SERIES:
        if runs == 1:
            return {"color": f"C{series}"}
        return {"color": f"C{run}", "linestyle": SERIES_LINE_STYLES[series % len(SERIES_LINE_STYLES)]}
    return {"color": f"C{run}", **({"marker": "o", "linestyle": "--"} if key.startswith("eval_") else {})}


def _figure(stem: str, runs: list[tuple[str, list[dict[str, Any]]]]):
    """Plot `stem` of PLOTS, each run a line per series; None when no run has data for it."""
    from matplotlib.figure import Figure

    title, ylabel, keys = PLOTS[stem]
    fig = Figure(figsize=(7, 3.4), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for i, (label, rows) in enumerate(runs):
        for j, (key, series) in enumerate(keys):
            steps, values = _series(rows, key)
            if not steps:
                continue
            name = series if len(runs) == 1 else f"{label} {series}" if len(keys) > 1 else label
            ax.plot(steps, values, label=name, linewidth=1.5, markersize=4, **_line_style(stem, key, i, j, len(runs)))
            drawn = True
        for mark in restarts(rows):
            ax.axvline(mark.step, color=f"C{i}", linestyle=":", linewidth=1)
            ax.annotate(mark.label, (mark.step, 1), xycoords=("data", "axes fraction"), xytext=(-2, -4),
                        textcoords="offset points", rotation=90, va="top", ha="right", fontsize=7, color=f"C{i}")
    if not drawn:
        return None
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if stem in Y_LIMITS:
        ax.set_ylim(*Y_LIMITS[stem])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def figures(runs: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """One matplotlib Figure per plot that has data, each run a line (several runs: `--compare`)."""
    drawn = {stem: _figure(stem, runs) for stem in PLOTS}
    return {stem: fig for stem, fig in drawn.items() if fig is not None}


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
    """summary.json describes the last attempt; the eval before the first step and a DPO run's last step's rewards
    come from the rows, and the checkpoint resumed from is named relative to the run."""
    values = with_recorded_eval(summary or {}, rows)
    if values.get("initial_eval_loss") is None:
        values["initial_eval_loss"] = next((r["eval_loss"] for r in eval_rows(rows) if r["step"] == 0), None)
    if values.get("resumed_from"):
        values["resumed_from"] = str(values["resumed_from"]).rstrip("/").rsplit("/", 1)[-1]
    last_step = (train_rows(rows) or [{}])[-1]
    for name in ("accuracy", "margin"):
        if last_step.get(f"rewards/{name}") is not None:
            values[f"final_rewards/{name}"] = last_step[f"rewards/{name}"]
    return values


def with_recorded_eval(summary: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A stopped run's summary with the last evaluation metrics.jsonl recorded as its eval_loss (and a DPO run's eval
    rewards) when it has none of its own: a run stopped (Ctrl-C) before its next evaluation, or resumed and stopped
    again, evaluated all the same. `eval_step` says which step that evaluation was of."""
    values = dict(summary)
    if values.get("eval_loss") is not None or values.get("finished"):
        return values
    recorded = [r for r in eval_rows(rows) if r.get("step", 0) > 0]  # the one before the first step is initial_eval_loss
    if not recorded:
        return values
    last = recorded[-1]
    values.update({k: v for k, v in last.items() if k.startswith("eval_")}, eval_step=last.get("step"))
    return values


def summary_keys(runs: list[tuple[str, dict[str, Any] | None]]) -> tuple[tuple[str, str], ...]:
    """SUMMARY_KEYS, with DPO_SUMMARY_KEYS after eval_loss when some run has one of them."""
    if not any((s or {}).get(key) is not None for _, s in runs for key, _ in DPO_SUMMARY_KEYS):
        return SUMMARY_KEYS
    at = [key for key, _ in SUMMARY_KEYS].index("eval_loss") + 1
    return SUMMARY_KEYS[:at] + DPO_SUMMARY_KEYS + SUMMARY_KEYS[at:]


def summary_table(runs: list[tuple[str, dict[str, Any] | None]]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for label, _ in runs)
    body = []
    for key, fmt in summary_keys(runs):
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
