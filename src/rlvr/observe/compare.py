"""`rlvr runs compare RUN_A RUN_B ...`: the key curves of several runs on shared plots, and one table.

Writes OUT/compare.html, OUT/compare.md and one PNG per curve (x = step, one line per run); a curve no
run logged is left out. The table (`summary_rows`) gives per run: steps trained, final reward (mean
of the last 5 logged steps), best and final held-out accuracy, final entropy (last 5), wall time
(first to last `time` stamp in metrics.jsonl), algorithm and model from config.yaml.

This module also reads a run back (`load_run`: every metric as a finite (steps, values) series,
alert rows and keys as `Alert`s, config.yaml) and holds the plot and page pieces `rlvr report`
(report.py) shares: `plot`, the summary row, `page` and `figure_html`.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rlvr.errors import ConfigError

if TYPE_CHECKING:
    from rich.table import Table

# ---------------------------------------------------------------- reading a run

Series = tuple[list[int], list[float]]  # (steps, values), ascending steps, finite values only


@dataclass(frozen=True)
class AlertMark:
    """A monitor's alert as read back: from its event row, or from its `alerts/<name>` key alone."""

    step: int
    name: str
    message: str = ""
    action: str = ""
    evidence: str = ""  # the event row's evidence numbers, as `key=value` text


@dataclass
class RunData:
    run_dir: Path
    series: dict[str, Series]
    alerts: list[AlertMark]
    config: dict[str, Any]
    config_text: str
    times: list[float] = field(default_factory=list)  # of metric rows, ascending
    last_step: int = 0  # the last step with a `reward` key (null included), else the last step

    @property
    def name(self) -> str:
        return self.run_dir.resolve().name


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def load_run(run_dir: Path) -> RunData:
    """Read RUN_DIR's metrics.jsonl (and config.yaml when there). A half-written last line (a run
    still writing) is ignored; any other unreadable line is an error."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"'{run_dir}' is not a directory (expected a run directory)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl (not a run directory?)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines):
                break
            raise ConfigError(f"'{path}' line {i} is not JSON: {err}") from err
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    if not rows:
        raise ConfigError(f"'{path}' holds no metric rows (no step logged yet)")

    points: dict[str, dict[int, float]] = {}
    alerts: dict[tuple[int, str], AlertMark] = {}
    times = []
    for row in rows:
        step = row["step"]
        if (t := number(row.get("time"))) is not None and "event" not in row:
            times.append(t)
        if "event" in row:
            name = str(row["event"])
            evidence = row.get("evidence")
            evidence = evidence if isinstance(evidence, dict) else {}
            alerts[step, name] = AlertMark(
                step,
                name,
                str(row.get("message") or ""),
                str(row.get("action") or ""),
                " ".join(f"{k}={fmt(number(v))}" for k, v in evidence.items()),
            )
            continue
        for key, value in row.items():
            if key in ("step", "time") or (v := number(value)) is None:
                continue
            if key.startswith("alerts/"):
                if v > 0:
                    name = key.removeprefix("alerts/")
                    alerts.setdefault((step, name), AlertMark(step, name))
            else:
                points.setdefault(key, {})[step] = v
    series = {k: (sorted(p), [p[s] for s in sorted(p)]) for k, p in points.items()}

    config_text, config = "", {}
    if (run_dir / "config.yaml").is_file():
        config_text = (run_dir / "config.yaml").read_text()
        try:
            loaded = yaml.safe_load(config_text)
        except yaml.YAMLError:
            loaded = None  # still shown as text; the table says "-" for algorithm and model
        config = loaded if isinstance(loaded, dict) else {}
    ordered = sorted(alerts.values(), key=lambda a: (a.step, a.name))
    trained = [r["step"] for r in rows if "reward" in r] or [r["step"] for r in rows]
    return RunData(run_dir, series, ordered, config, config_text, sorted(times), max(trained))


# ---------------------------------------------------------------- the summary table


@dataclass(frozen=True)
class RunSummary:
    run: str
    algorithm: str
    model: str
    steps: int
    final_reward: float | None  # mean `reward` over the last 5 logged steps
    best_accuracy: float | None  # max `eval/accuracy`
    final_accuracy: float | None  # last `eval/accuracy`
    final_entropy: float | None  # mean `entropy` over the last 5 logged steps
    wall_seconds: float | None  # last `time` - first `time`; sum of `step_time` without two times
    placebo: bool = False  # trained with objective.placebo (rewards shuffled within groups)
    # final_accuracy less the placebo run's, when a placebo run is compared alongside (compare)
    over_placebo: float | None = None


def _tail_mean(run: RunData, key: str, n: int = 5) -> float | None:
    values = run.series.get(key, ([], []))[1]
    return statistics.fmean(values[-n:]) if values else None


def summary_row(run: RunData, label: str | None = None) -> RunSummary:
    acc = run.series.get("eval/accuracy", ([], []))[1]
    model = str((run.config.get("model") or {}).get("name", "-"))
    if model.startswith("/"):
        model = Path(model).name  # a local directory: its name says enough in a table
    wall = run.times[-1] - run.times[0] if len(run.times) > 1 else None
    if wall is None and "step_time" in run.series:
        wall = sum(run.series["step_time"][1])
    return RunSummary(
        run=label or run.name,
        algorithm=str(run.config.get("algorithm", "-")),
        model=model,
        steps=run.last_step,
        final_reward=_tail_mean(run, "reward"),
        best_accuracy=max(acc) if acc else None,
        final_accuracy=acc[-1] if acc else None,
        final_entropy=_tail_mean(run, "entropy"),
        wall_seconds=wall,
        placebo=(run.config.get("objective") or {}).get("placebo", "none") != "none",
    )


SUMMARY_HEADERS = (
    "run", "algorithm", "model", "steps", "final reward", "best acc", "final acc",
    "gain over placebo", "final entropy", "wall time",
)  # fmt: skip
SUMMARY_NOTE = (
    "final reward and entropy: mean of the last 5 logged steps; acc: held-out eval/accuracy; "
    "gain over placebo: final acc less that of the placebo run compared alongside (rewards "
    "shuffled within groups: the part of a gain the reward taught); "
    "wall time: first to last time stamp in metrics.jsonl"
)


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def fmt(value: float | None, digits: int = 3, signed: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    sign = "+" if signed else ""
    return (
        f"{value:{sign}.{digits}g}" if value and abs(value) < 1e-3 else f"{value:{sign}.{digits}f}"
    )


def summary_cells(row: RunSummary) -> list[str]:
    return [
        row.run, row.algorithm, row.model, str(row.steps), fmt(row.final_reward),
        fmt(row.best_accuracy), fmt(row.final_accuracy),
        "placebo" if row.placebo else fmt(row.over_placebo, signed=True),
        fmt(row.final_entropy), duration(row.wall_seconds),
    ]  # fmt: skip


def summary_table_html(rows: Sequence[RunSummary]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in SUMMARY_HEADERS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in summary_cells(r)) + "</tr>"
        for r in rows
    )
    note = f'<p class="kv">{html.escape(SUMMARY_NOTE)}</p>'
    return f'<table class="summary"><tr>{head}</tr>{body}</table>{note}'


# ---------------------------------------------------------------- plots

SMOOTH_ABOVE = 150  # points; longer curves are drawn raw (light) with an EMA on top


def ema(values: Sequence[float]) -> list[float]:
    """Exponential moving average with a span of 1/30 of the curve (at least 5 points)."""
    alpha = 2 / (max(5, len(values) // 30) + 1)
    out, acc = [], values[0]
    for v in values:
        acc = alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def plot(
    path: Path,
    title: str,
    lines: Sequence[tuple[str, Series]],
    alerts: Sequence[AlertMark] = (),
    markers: bool = False,
    colors: Sequence[str] | None = None,
) -> int:
    """Write one line plot to `path` (x = step); returns the number of alert markers drawn.

    Without `colors` the first line (a total, a mean) is drawn wide and underneath the others, so a
    component equal to it stays visible on top instead of hiding it; with `colors` (one per line,
    e.g. one per run) all lines are peers."""
    from matplotlib.figure import Figure  # the OO API: no pyplot state, the Agg canvas
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.4), dpi=110)
    # fixed margins, not layout="constrained": that measures every label and doubles the time
    fig.subplots_adjust(left=0.1, right=0.98, top=0.91, bottom=0.14)
    ax = fig.subplots()
    for i, (label, (steps, values)) in enumerate(lines):
        first = i == 0 and len(lines) > 1 and colors is None
        width, z = (2.6, 1.5) if first else (1.3, 2.0)
        color = colors[i] if colors is not None else f"C{i % 10}"
        if len(steps) > SMOOTH_ABOVE and not markers:  # raw in light, an EMA over it
            ax.plot(steps, values, color=color, lw=0.7, alpha=0.3, zorder=z)
            ax.plot(steps, ema(values), color=color, label=label, lw=width, zorder=z)
        else:
            sparse = markers or len(steps) <= 40
            ax.plot(steps, values, color=color, label=label, lw=width,
                    marker="o" if sparse else None, ms=4 if first else 3, zorder=z)  # fmt: skip
    positive = [v for _, (_, vs) in lines for v in vs]
    if positive and min(positive) > 0 and max(positive) / min(positive) > 100:
        ax.set_yscale("log")  # a spike (grad norm, KL) would flatten the rest of the curve
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    drawn, last_label = 0, None
    by_step: dict[int, list[str]] = {}
    for a in alerts:
        by_step.setdefault(a.step, []).append(a.name)
    xs = [s for _, (steps, _) in lines for s in steps] + list(by_step)
    min_gap = (max(xs) - min(xs)) * 0.04 if xs else 0
    for step, names in sorted(by_step.items()):
        ax.axvline(step, color="#d00", ls="--", lw=1, alpha=0.8, zorder=3)
        drawn += 1
        if last_label is None or step - last_label >= min_gap:  # labels closer than this overlap
            text = ", ".join(dict.fromkeys(names))
            ax.text(step, 0.98, text, rotation=90, va="top", ha="right", fontsize=7, zorder=4,
                    color="#b00", transform=ax.get_xaxis_transform(), clip_on=True,
                    bbox={"fc": "white", "ec": "none", "alpha": 0.75, "pad": 1})  # fmt: skip
            last_label = step
    if len(lines) > 1:
        ax.legend(fontsize=7, framealpha=0.85, loc="best")
    fig.savefig(path)
    return drawn


# ---------------------------------------------------------------- compare

KEY_CURVES = (
    ("reward", "Reward"),
    ("eval/accuracy", "Held-out accuracy"),
    ("entropy", "Policy entropy (nats / token)"),
    ("kl", "KL to the reference policy"),
    ("completions/mean_length", "Mean completion length (tokens)"),
    ("grad_norm", "Gradient norm (before clipping)"),
)


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's folder name; parent/name where two runs share a name (runs/a/run, runs/b/run)."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [
        f"{Path(d).resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for d, n in zip(run_dirs, names, strict=True)
    ]


def _load(run_dirs: Sequence[Path]) -> list[tuple[str, RunData]]:
    if not run_dirs:
        raise ConfigError("give at least one run directory to compare")
    return list(zip(_labels(run_dirs), [load_run(Path(d)) for d in run_dirs], strict=True))


def summary_rows(run_dirs: Sequence[Path]) -> list[RunSummary]:
    """One summary per run, in the order given (see `RunSummary` for what each number is). When
    a placebo run (`objective.placebo`) is among them, every other run's final held-out accuracy
    is also given over the first placebo run's (`over_placebo`)."""
    rows = [summary_row(run, label) for label, run in _load(run_dirs)]
    placebo = next((r for r in rows if r.placebo and r.final_accuracy is not None), None)
    if placebo is None or placebo.final_accuracy is None:
        return rows
    return [
        r
        if r.placebo or r.final_accuracy is None
        else dataclasses.replace(r, over_placebo=r.final_accuracy - placebo.final_accuracy)
        for r in rows
    ]


def summary_table(rows: Sequence[RunSummary]) -> Table:
    """The summary as a rich Table, for the CLI to print."""
    from rich.table import Table

    table = Table(title="runs compared", caption=SUMMARY_NOTE)
    for i, header in enumerate(SUMMARY_HEADERS):
        table.add_column(header, justify="right" if i >= 3 else "left")
    for row in rows:
        table.add_row(*summary_cells(row))
    return table


def summary_markdown(rows: Sequence[RunSummary]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join(
        [
            line(SUMMARY_HEADERS),
            line(["---"] * len(SUMMARY_HEADERS)),
            *(line(summary_cells(r)) for r in rows),
        ]
    )


# ---------------------------------------------------------------- the page (also report.py's)

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1em 2em;color:#222;background:#fff;max-width:1500px}
h1{font-size:1.35em}h2{font-size:1.15em;margin:1.6em 0 .5em;border-bottom:2px solid #ccc}
h3{font-size:1em;margin:1.2em 0 .3em}h4{margin:.3em 0;font-size:.9em;color:#555}
nav a{margin-right:1em}.kv{color:#666;font-weight:normal;font-size:.9em}
table{border-collapse:collapse;font-size:.9em;margin:.4em 0}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}th{background:#f4f4f4}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1em}
figure{margin:0;border:1px solid #e4e4e4;border-radius:4px;padding:.3em}
figure img{width:100%;height:auto;display:block}
figcaption{font-size:.8em;color:#666;padding:0 .4em}
.cols{display:grid;grid-template-columns:1fr 1fr;gap:1em}
.ro{border:1px solid #ddd;border-radius:4px;margin:.4em 0;padding:.4em .6em}.hdr{font-size:.85em}
pre{font:12px/1.45 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;overflow-wrap:anywhere;
 margin:.3em 0;background:#fafafa;padding:.3em}
pre.prompt,pre .obs{color:#777}details>summary{cursor:pointer;color:#555;font-size:.85em}
.bad,.alert{color:#b00}
"""

# Counts the images that decoded; a headless browser reads the result from the dumped DOM.
IMAGE_CHECK = """<script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.dataset.imagesLoaded = ok + "/" + imgs.length;
});
</script>"""


def page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>"
        f"{body}{IMAGE_CHECK}</body></html>\n"
    )


def figure_html(png: str, caption: str, markers: int) -> str:
    return (
        f'<figure data-alert-markers="{markers}"><img src="{html.escape(png)}" '
        f'alt="{html.escape(caption)}"><figcaption>{html.escape(caption)}</figcaption></figure>'
    )


def compare_runs(run_dirs: list[Path], out: Path) -> Path:
    """Write compare.html, compare.md and the PNGs to `out`; returns compare.html's path."""
    runs = _load(run_dirs)
    rows = [summary_row(run, label) for label, run in runs]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures, pngs = [], []
    for key, title in KEY_CURVES:
        have = [i for i, (_, run) in enumerate(runs) if key in run.series]
        if not have:
            continue
        lines = [(runs[i][0], runs[i][1].series[key]) for i in have]
        png = key.replace("/", "_") + ".png"
        colors = [f"C{i % 10}" for i in have]  # a run keeps its colour on every plot
        plot(out / png, title, lines, markers=key.startswith("eval/"), colors=colors)
        missing = [label for label, run in runs if key not in run.series]
        caption = key + (f" (not logged by {', '.join(missing)})" if missing else "")
        figures.append(figure_html(png, caption, 0))
        pngs.append((title, png))

    esc = html.escape
    body = (
        f"<h1>rlvr · {len(runs)} runs compared</h1>"
        + "<ul>"
        + "".join(
            f"<li>{esc(label)}: {esc(str(run.run_dir.resolve()))}</li>" for label, run in runs
        )
        + "</ul>"
        + summary_table_html(rows)
        + f'<div class="plots">{"".join(figures)}</div>'
    )
    target = out / "compare.html"
    target.write_text(page(f"rlvr · {len(runs)} runs compared", body), encoding="utf-8")
    md = [
        f"# {len(runs)} runs compared",
        "",
        *(f"- {label}: `{run.run_dir.resolve()}`" for label, run in runs),
        "",
        summary_markdown(rows),
        "",
        SUMMARY_NOTE[0].upper() + SUMMARY_NOTE[1:] + ".",
        "",
        *(f"![{title}]({png})" for title, png in pngs),
        "",
    ]
    (out / "compare.md").write_text("\n".join(md), encoding="utf-8")
    return target
