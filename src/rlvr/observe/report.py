"""`rlvr report RUN_DIR`: a run's curves, alerts, best and worst rollouts and config as a static folder.

RUN_DIR/report/ (or `out`) gets index.html plus one PNG per plot; every path in the page is relative
and the page needs no server or network, so the folder can be copied or opened from file://. A plot
whose metrics the run never logged (no KL without `beta`, no critic without PPO) is left out, and so
are tool and turn plots of a run that never called a tool or took a second turn.

Monitors write alerts into metrics.jsonl two ways: an event row {"step", "time", "event": name,
"message", "action", "evidence"} (no metrics in it) and a per-step key `alerts/<name>` = 1.0. Both become one `AlertMark`; each
is a dashed red line labelled with its name on every plot, and a row in the alerts table.

The page carries one small inline script: on load it counts the images that decoded and writes
`data-images-loaded="N/M"` on <body>, so a headless browser can check the page in one `--dump-dom`.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvr.observe.compare import (
    SMOOTH_ABOVE,
    AlertMark,
    RunData,
    Series,
    figure_html,
    fmt,
    load_run,
    number,
    page,
    plot,
    summary_row,
    summary_table_html,
)

# ---------------------------------------------------------------- which plots


@dataclass(frozen=True)
class Panel:
    slug: str
    title: str
    # (key, label); a `*` in the key matches one path segment and `{}` in the label takes its text
    curves: tuple[tuple[str, str], ...]
    active: Callable[[dict[str, list[float]]], bool] = lambda values: True
    markers: bool = False  # sparse metrics (held-out eval): draw the points


def _any_nonzero(values: dict[str, list[float]]) -> bool:
    return any(v != 0 for vs in values.values() for v in vs)


PANELS = (
    Panel("reward", "Reward: total and per component", (("reward", "reward (weighted)"), ("rewards/*/mean", "{}"), ("reward/verifiable", "verifiable"), ("reward/non_verifiable", "non-verifiable"))),
    Panel("eval_accuracy", "Held-out accuracy", (("eval/accuracy", "held-out accuracy"), ("eval/*/accuracy", "{}"), ("eval/pass@k", "pass@k")), markers=True),
    Panel("source_reward", "Training reward per source", (("env/*/reward", "{}"),)),
    Panel("entropy", "Policy entropy (nats / token)", (("entropy", "entropy (trainer)"), ("completions/neg_logprob_mean", "-log p of sampled tokens"))),
    Panel("kl", "KL to the reference policy", (("kl", "kl"),)),
    Panel("completion_length", "Completion length (policy tokens)", (("completions/mean_length", "mean"), ("completions/max_length", "max"), ("completions/min_length", "min"))),
    Panel("truncated", "Completions cut at max_new_tokens", (("completions/clipped_ratio", "clipped ratio"),)),
    Panel("clip_ratio", "Policy-ratio clipping", (("clip_ratio/low_mean", "low"), ("clip_ratio/high_mean", "high"), ("clip_ratio/region_mean", "region"))),
    Panel("grad_norm", "Gradient norm (before clipping)", (("grad_norm", "policy"), ("critic/grad_norm", "critic"))),
    Panel("group_signal", "Group signal: groups with no reward spread, in-group std", (("frac_reward_zero_std", "frac reward zero std"), ("reward_std_in_group", "in-group reward std"), ("rollout/in_group_std", "rollout/in_group_std"), ("reward_std", "batch reward std (TRL's reward_std)"))),
    Panel("tools", "Tool use", (("tools/call_frequency", "calls per episode"), ("tools/failure_frequency", "failed share of calls"), ("tools/call_rate", "episodes with a call")), active=_any_nonzero),
    Panel("tool_errors", "Tool errors by kind", (("tools/errors/*", "{}"),), active=_any_nonzero),
    Panel("turns", "Turns per episode", (("turns/mean", "mean"), ("turns/max", "max"), ("turns/max_turns_ratio", "hit max_turns")), active=lambda v: any(x > 1 for x in v.get("turns/max", [])) or _any_nonzero({"r": v.get("turns/max_turns_ratio", [])})),
    Panel("critic_fit", "Critic: value loss, explained variance, clip fraction", (("critic/value_loss", "value loss"), ("critic/explained_variance", "explained variance"), ("critic/vf_clipfrac", "clip fraction"))),
    Panel("critic_values", "Critic values vs returns", (("critic/values_mean", "values"), ("critic/returns_mean", "returns"))),
    Panel("curriculum", "Curriculum: level, rolling success, mixture weights", (("curriculum/level", "level (index into curriculum.levels)"), ("curriculum/success", "rolling success"), ("curriculum/weight/*", "weight {}"))),
    Panel("step_time", "Seconds per step", (("step_time", "step"), ("rollout_time", "rollout"), ("update_time", "update"))),
    Panel("throughput", "Policy update: model GFLOP/s achieved", (("perf/update_gflops_per_s", "update"),)),
)  # fmt: skip


def panel_curves(panel: Panel, series: dict[str, Series]) -> list[tuple[str, str]]:
    """The (metric key, legend label) pairs of `panel` that this run logged, in panel order."""
    out: list[tuple[str, str]] = []
    for pattern, label in panel.curves:
        if "*" not in pattern:
            if pattern in series:
                out.append((pattern, label))
            continue
        regex = re.compile(re.escape(pattern).replace(r"\*", "([^/]+)"))
        for key in sorted(series):
            if (m := regex.fullmatch(key)) and key not in dict(out):
                out.append((key, label.format(m[1])))
    return out


# ---------------------------------------------------------------- best and worst rollouts


def _read_rollouts(run_dir: Path, keep: int = 3) -> dict[int, list[dict[str, Any]]]:
    """Per step, the `keep` best then the `keep` worst rollouts by reward (all when fewer), read in
    one pass without holding the whole file (it grows with every step)."""
    path = run_dir / "rollouts.jsonl"
    if not path.is_file():
        return {}
    kept: dict[int, list[dict[str, Any]]] = {}

    def reduce(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ranked = sorted(rows, key=lambda r: -(r["_reward"]))
        return ranked if len(ranked) <= 2 * keep else ranked[:keep] + ranked[-keep:]

    with path.open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a half-written line of a live run
            reward = number(row.get("reward")) if isinstance(row, dict) else None
            if reward is None or not isinstance(row.get("step"), int):
                continue
            row["_reward"] = reward
            rows = kept.setdefault(row["step"], [])
            rows.append(row)
            if len(rows) > 8 * keep:
                kept[row["step"]] = reduce(rows)
    return {step: reduce(rows) for step, rows in kept.items()}


def _prompts(run_dir: Path, step: int) -> dict[str, str]:
    """task id -> prompt text, from trajectories/step_N.jsonl (rollouts.jsonl has no prompt)."""
    path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
    out: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                out.setdefault(str(row["task_id"]), "".join(row["tokens"][: row["prompt_length"]]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return out


def _rollout_html(row: dict[str, Any], prompt: str | None) -> str:
    esc = html.escape
    parts = [f"reward <b>{fmt(row['_reward'])}</b>"]
    parts += [f"{esc(str(k))} {fmt(number(v))}" for k, v in (row.get("rewards") or {}).items()]
    parts += [f"{k.replace('_', ' ')} {esc(str(row[k]))}" for k in ("finish_reason", "num_tokens", "num_turns") if k in row]  # fmt: skip
    if row.get("errors"):
        parts.append(f'<span class="bad">errors {esc(json.dumps(row["errors"]))}</span>')
    head = f"task {esc(str(row.get('task_id')))}" + (
        f" · {esc(str(row['source']))}" if row.get("source") else ""
    )
    turn_rewards = row.get("turn_rewards") or []
    if len(turn_rewards) > 1:
        parts.append("turn rewards " + ", ".join(fmt(number(r)) for r in turn_rewards))
    messages = [m for m in row.get("messages") or [] if isinstance(m, dict)]
    if len(messages) > 1:  # multi-turn: the assistant's turns, and what the env answered in grey
        body = "\n".join(
            f'<span class="{"" if m.get("role") == "assistant" else "obs"}">'
            f"[{esc(str(m.get('role')))}] {esc(str(m.get('content', '')))}</span>"
            for m in messages
        )
    else:
        body = esc(str(row.get("completion", ""))) or "<i>(empty)</i>"
    prompt_html = (
        f'<details><summary>prompt</summary><pre class="prompt">{esc(prompt)}</pre></details>'
        if prompt
        else ""
    )
    return (
        f'<div class="ro"><div class="hdr">{head}<br>{" · ".join(parts)}</div>{prompt_html}'
        f"<pre>{body}</pre></div>"
    )


def _rollouts_section(run: RunData, keep: int = 3) -> str:
    by_step = _read_rollouts(run.run_dir, keep)
    if not by_step:
        return "<p>No rollouts.jsonl in this run.</p>"
    steps = sorted(by_step)
    sampled = list(dict.fromkeys([steps[0], steps[len(steps) // 2], steps[-1]]))
    out = []
    for step in sampled:
        rows, prompts = by_step[step], _prompts(run.run_dir, step)
        best, worst = (rows[:keep], rows[keep:][::-1]) if len(rows) > keep else (rows, [])
        cols = [("best", best), ("worst", worst)] if worst else [("all", best)]
        mean = dict(zip(*run.series.get("reward", ([], [])), strict=True)).get(step)
        out.append(
            f'<h3 id="rollouts-{step}">step {step} <span class="kv">mean reward {fmt(mean)}</span></h3>'
            '<div class="cols">'
            + "".join(
                f"<div><h4>{name} {len(rs)}</h4>"
                + "".join(_rollout_html(r, prompts.get(str(r.get("task_id")))) for r in rs)
                + "</div>"
                for name, rs in cols
            )
            + "</div>"
        )
    return "".join(out)


def _equal(a: Series, b: Series) -> bool:
    """Equal curves, up to float32 rounding (reward_std_in_group and rollout/in_group_std are one
    number when no group is filtered out)."""
    return a[0] == b[0] and all(
        abs(x - y) <= 1e-6 * (1 + abs(x)) for x, y in zip(a[1], b[1], strict=True)
    )


def _alerts_html(alerts: Sequence[AlertMark], limit: int = 500) -> str:
    if not alerts:
        return "<p>No alerts were raised in this run.</p>"
    esc = html.escape
    rows = "".join(
        f'<tr class="alert"><td>{a.step}</td><td>{esc(a.name)}</td><td>{esc(a.action)}</td>'
        f"<td>{esc(a.message)}</td><td>{esc(a.evidence)}</td></tr>"
        for a in alerts[:limit]
    )
    more = f"<p>... and {len(alerts) - limit} more</p>" if len(alerts) > limit else ""
    return (
        f"<p>{len(alerts)} alert(s); each is a dashed red line on every plot.</p><table><tr>"
        "<th>step</th><th>alert</th><th>action</th><th>message</th><th>evidence</th></tr>"
        f"{rows}</table>{more}"
    )


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report of RUN_DIR to `out` (default RUN_DIR/report/); returns its index.html."""
    run = load_run(run_dir)
    out = Path(out) if out is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    weights = {
        str(r.get("name")): r.get("weight")
        for r in run.config.get("rewards") or []
        if isinstance(r, dict)
    }
    figures = []
    # A curriculum's promotions are event rows too: marked on its own plot, not listed as alerts.
    promotions = [a for a in run.alerts if a.name.startswith("curriculum/")]
    alerts = [a for a in run.alerts if not a.name.startswith("curriculum/")]
    for panel in PANELS:
        curves = panel_curves(panel, run.series)
        if not curves or not panel.active({k: run.series[k][1] for k, _ in curves}):
            continue
        lines: list[tuple[str, Series]] = []
        for key, label in curves:
            name = key.split("/")[1] if key.startswith("rewards/") else None
            if name is not None and weights.get(name) == 0:
                label += " (weight 0: logged only)"
            same = [i for i, (_, s) in enumerate(lines) if _equal(s, run.series[key])]
            if same:  # one line for equal curves (reward = its only optimised component)
                lines[same[0]] = (f"{lines[same[0]][0]} = {label}", lines[same[0]][1])
            else:
                lines.append((label, run.series[key]))
        marks = promotions if panel.slug == "curriculum" else alerts
        markers = plot(out / f"{panel.slug}.png", panel.title, lines, marks, panel.markers)
        figures.append(figure_html(f"{panel.slug}.png", ", ".join(k for k, _ in curves), markers))

    esc = html.escape
    title = f"rlvr report · {run.name}"
    body = (
        f"<h1>{esc(title)}</h1><p class=kv>{esc(str(run.run_dir.resolve()))}</p>"
        '<nav><a href="#curves">curves</a><a href="#alerts">alerts</a>'
        '<a href="#rollouts">rollouts</a><a href="#config">config</a></nav>'
        + summary_table_html([summary_row(run)])
        + f'<h2 id="curves">Curves</h2><p class="kv">x = training step; dashed red lines: alerts; '
        f"curves over {SMOOTH_ABOVE} points: raw (light) with an exponential moving average; a "
        "curve spanning over 100x is on a log scale. Under each plot: the metrics it shows.</p>"
        f'<div class="plots">{"".join(figures)}</div>'
        + f'<h2 id="alerts">Alerts</h2>{_alerts_html(alerts)}'
        + '<h2 id="rollouts">Best and worst rollouts</h2>'
        + "<p>The first, middle and last step with rollouts; the top and bottom by reward.</p>"
        + _rollouts_section(run)
        + f'<h2 id="config">Config</h2><pre>{esc(run.config_text or "(no config.yaml)")}</pre>'
    )
    index = out / "index.html"
    index.write_text(page(title, body), encoding="utf-8")
    return index
