"""`rlvr inspect`: one training step's trajectories as a static, self-contained HTML page.

The training loop saves each step's trajectories to RUN_DIR/trajectories/step_NNNNNN.jsonl (one row per
trajectory, from `trajectory_rows`); `render_html` turns one such file into RUN_DIR/inspect/step_NNNNNN.html.
Every token is a <span>: class `pol` (policy_mask 1, got gradient) with `adv-pos` / `adv-neg` / `adv-0`
and a green / red background whose strength is |advantage| over the step's largest, or class `msk`
(prompt, observations, template glue: grey, italic, dotted border). Trajectories are grouped by task id
(a GRPO group), or sorted by reward, optionally filtered to a reward range; each header shows the
reward parts and, for multi-turn episodes, each turn's reward. Every page links to the previous and next
saved steps (`render_all` writes them all). No scripts, no network: the page opens from disk.

`marked_text` renders a token run for a terminal (trained tokens in [[...]]): `rlvr env check` uses it.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from rlvr.errors import ConfigError
from rlvr.records import Trajectory

_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")


class _Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


def _num(value: Any) -> float | None:
    """A finite float, or None (JSON has no NaN / inf)."""
    value = float(value)
    return value if math.isfinite(value) else None


def trajectory_rows(
    trajectories: Sequence[Trajectory],
    token_advantages: Sequence[Sequence[float]],
    tokenizer: _Decoder,
) -> list[dict[str, Any]]:
    """One JSON-serialisable row per trajectory for the step file.

    `token_advantages[i]` covers trajectory i's completion (the tokens after its prompt); it is cut to
    that length (a padded batch row is longer) and padded with 0.0 if shorter. Each token is decoded on
    its own, so `tokens` lines up with `token_ids` one to one.
    """
    if len(token_advantages) != len(trajectories):
        raise ValueError(
            f"{len(trajectories)} trajectories but {len(token_advantages)} advantage rows"
        )
    cache: dict[int, str] = {}

    def piece(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id])
        return cache[token_id]

    rows = []
    for traj, advantages in zip(trajectories, token_advantages, strict=True):
        n_completion = len(traj.token_ids) - traj.prompt_length
        completion = [_num(a) for a in list(advantages)[:n_completion]]
        completion += [0.0] * (n_completion - len(completion))
        info = {
            str(k): (int(v) if isinstance(v, int) else _num(v))
            for k, v in traj.info.items()
            if isinstance(v, int | float)
        }
        rows.append(
            {
                "task_id": traj.task_id,
                "source": traj.source,
                "reward": _num(traj.reward),
                "turn_rewards": [_num(r) for r in traj.turn_rewards],
                "rewards": {k: _num(v) for k, v in traj.rewards.items()},
                "reward_errors": list(traj.reward_errors),
                "finish_reason": traj.finish_reason,
                "prompt_length": traj.prompt_length,
                "turns": [[span.start, span.end] for span in traj.turns],
                "info": info,
                "messages": json.loads(json.dumps(list(traj.messages), default=str)),
                "tokens": [piece(t) for t in traj.token_ids],
                "token_ids": list(traj.token_ids),
                "policy_mask": list(traj.policy_mask),
                "logprobs": [_num(lp) for lp in traj.logprobs],
                "advantages": [0.0] * traj.prompt_length + completion,
            }
        )
    return rows


def write_step_trajectories(run_dir: Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """Write RUN_DIR/trajectories/step_{step:06d}.jsonl (replacing a previous one); returns its path."""
    path = Path(run_dir) / "trajectories" / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def available_steps(run_dir: Path) -> list[int]:
    """Steps with a saved trajectories file, ascending ([] when there is no trajectories/ folder)."""
    folder = Path(run_dir) / "trajectories"
    if not folder.is_dir():
        return []
    return sorted(int(m[1]) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name)))


def _steps_text(steps: list[int]) -> str:
    if len(steps) <= 12:
        return ", ".join(map(str, steps))
    head, tail = ", ".join(map(str, steps[:5])), ", ".join(map(str, steps[-5:]))
    return f"{head}, ..., {tail} ({len(steps)} steps)"


def _read_rows(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read '{path}': {err}".replace("\n", " ")) from err


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222;background:#fff}
h1{font-size:1.3em}h2{font-size:1.1em;margin:1.6em 0 .4em;border-bottom:2px solid #ccc}
.legend .lg{margin-right:.6em}
.traj{border:1px solid #ddd;border-radius:4px;margin:.6em 0;padding:.4em .6em}
.hdr{font-size:.9em;margin-bottom:.3em}.hdr b{font-size:1.05em}.kv{color:#555;margin-right:1em}
.toks{font:12px/1.6 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;overflow-wrap:anywhere}
details.prompt>summary{cursor:pointer;color:#555;font-size:.85em}
.tok,.lg{border:1px solid transparent;border-radius:2px}
.pol{color:#000}.adv-0{background:#f4f4f4}
.msk{color:#888;font-style:italic;background:#eee;border:1px dotted #bbb}
.bnd{display:inline-block;font:bold 10px system-ui,sans-serif;color:#fff;background:#447;
 border-radius:3px;padding:0 .4em;margin:0 .2em;font-style:normal}
.bnd.obs{background:#999}
.ok{color:#070}.bad{color:#b00}
nav.steps{font-size:.9em;margin-bottom:.4em}nav.steps a{margin:0 .6em}
"""


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "nan"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-3 and value else f"{value:.{digits}f}"
    return str(value)


def _token_html(row: dict[str, Any], t: int, scale: float) -> str:
    text = row["tokens"][t]
    shown = html.escape(text).replace("\n", "↵\n") if text else "∅"
    adv = row["advantages"][t]
    title = html.escape(
        f"id {row['token_ids'][t]} · logprob {_fmt(row['logprobs'][t])} · advantage {_fmt(adv)}"
        + ("" if row["policy_mask"][t] else " · masked"),
        quote=True,
    )
    if not row["policy_mask"][t]:
        return f'<span class="tok msk" title="{title}">{shown}</span>'
    a = adv or 0.0
    if a == 0.0:
        return f'<span class="tok pol adv-0" title="{title}">{shown}</span>'
    alpha = 0.12 + 0.78 * min(abs(a) / scale, 1.0)
    cls, rgb = ("adv-pos", "0,170,60") if a > 0 else ("adv-neg", "220,30,30")
    style = f"background:rgba({rgb},{alpha:.2f})"
    return f'<span class="tok pol {cls}" style="{style}" title="{title}">{shown}</span>'


def _turn_rewards_text(row: dict[str, Any]) -> str:
    """ "turn rewards a, b, c" (each turn's weighted reward) for multi-turn rows; "" otherwise (and
    for step files written before rows carried them)."""
    turn_rewards = row.get("turn_rewards") or []
    if len(turn_rewards) < 2:
        return ""
    return "turn rewards " + ", ".join(_fmt(r) for r in turn_rewards)


def _trajectory_html(index: int, row: dict[str, Any], scale: float) -> str:
    esc = html.escape
    info = row.get("info") or {}
    rewards = row.get("rewards") or {}
    n = len(row["token_ids"])
    parts = [
        f"<b>#{index}</b> task {esc(str(row['task_id']))}",
        f"reward <b>{_fmt(row.get('reward'))}</b>",
        " ".join(f"{esc(k)}={_fmt(v)}" for k, v in rewards.items()),
        f"finish {esc(str(row.get('finish_reason')))}",
        f"turns {len(row.get('turns') or [])}",
        _turn_rewards_text(row),
        f"tokens {n} (policy {sum(row['policy_mask'])})",
    ]
    if row.get("source"):
        parts.insert(1, f"source {esc(row['source'])}")
    if "tool_calls" in info:
        failures = info.get("tool_failures") or 0
        cls = "bad" if failures else "ok"
        parts.append(
            f'<span class="{cls}">tool calls {_fmt(info["tool_calls"])}, failures {_fmt(failures)}</span>'
        )
    if row.get("reward_errors"):
        parts.append(
            f'<span class="bad">reward errors: {esc(", ".join(row["reward_errors"]))}</span>'
        )
    others = {k: v for k, v in info.items() if k not in ("tool_calls", "tool_failures")}
    if others:
        parts.append(esc(" ".join(f"{k}={_fmt(v)}" for k, v in others.items())))
    header = "".join(f'<span class="kv">{p}</span>' for p in parts if p)

    prompt_length = row["prompt_length"]
    prompt = "".join(_token_html(row, t, scale) for t in range(prompt_length))
    starts = {start: k for k, (start, _end) in enumerate(row.get("turns") or [], 1)}
    mask = row["policy_mask"]
    body: list[str] = []
    for t in range(prompt_length, n):
        if t in starts:
            body.append(f'<span class="bnd">turn {starts[t]}</span>')
        elif starts and not mask[t] and mask[t - 1] and min(starts) < t < max(starts):
            # a masked run between two assistant turns: what the env sent back (and template glue)
            body.append('<span class="bnd obs">observation</span>')
        body.append(_token_html(row, t, scale))
    return (
        f'<div class="traj"><div class="hdr">{header}</div>'
        f'<details class="prompt"><summary>prompt ({prompt_length} tokens)</summary>'
        f'<div class="toks">{prompt}</div></details>'
        f'<div class="toks">{"".join(body)}</div></div>'
    )


Sort = Literal["group", "reward", "-reward"]


def _step_links(steps: list[int], step: int) -> str:
    """Links to the previous / next saved steps' pages (siblings in the same folder: write them
    all with `rlvr inspect --all`)."""
    i = steps.index(step)
    prev = f'<a href="step_{steps[i - 1]:06d}.html">&larr; step {steps[i - 1]}</a>' if i else ""
    nxt = (
        f'<a href="step_{steps[i + 1]:06d}.html">step {steps[i + 1]} &rarr;</a>'
        if i + 1 < len(steps)
        else ""
    )
    return f'<nav class="steps">{prev} <b>step {step}</b> {nxt}</nav>'


def render_html(
    run_dir: Path,
    step: int | None = None,
    out: Path | None = None,
    *,
    sort: Sort = "group",
    min_reward: float | None = None,
    max_reward: float | None = None,
) -> Path:
    """Render one step (None: the latest) to `out` (default RUN_DIR/inspect/step_NNNNNN.html).

    `sort`: "group" (by task, as sampled), "reward" (all trajectories, highest reward first) or
    "-reward" (lowest first). `min_reward` / `max_reward` keep only trajectories whose reward is in
    that range (a trajectory without a finite reward is dropped by either bound).
    """
    run_dir = Path(run_dir)
    folder = run_dir / "trajectories"
    if not folder.is_dir():
        raise ConfigError(
            f"'{run_dir}' has no trajectories/ folder (not a run directory, or no step saved yet)"
        )
    steps = available_steps(run_dir)
    if not steps:
        raise ConfigError(f"'{folder}' holds no step_NNNNNN.jsonl files")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(
            f"step {step} not saved in '{folder}'; available steps: {_steps_text(steps)}"
        )
    if sort not in ("group", "reward", "-reward"):
        raise ConfigError(f"sort '{sort}': expected group, reward or -reward")
    rows = _read_rows(folder / f"step_{step:06d}.jsonl")

    scale = max(
        (
            abs(a)
            for r in rows
            for a, m in zip(r["advantages"], r["policy_mask"], strict=False)
            if m and a
        ),
        default=1.0,
    )
    groups: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(str(row["task_id"]), []).append((i, row))
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    title = html.escape(f"{run_dir.name or run_dir} · step {step}")

    def shown(row: dict[str, Any]) -> bool:
        reward = row.get("reward")
        if min_reward is None and max_reward is None:
            return True
        if reward is None:
            return False
        return (min_reward is None or reward >= min_reward) and (
            max_reward is None or reward <= max_reward
        )

    kept = [(i, r) for i, r in enumerate(rows) if shown(r)]
    sections = []
    if sort == "group":
        for task_id, members in groups.items():
            visible = [(i, r) for i, r in members if shown(r)]
            if not visible:
                continue
            rs = [r["reward"] for _, r in members if r.get("reward") is not None]
            group_mean = sum(rs) / len(rs) if rs else float("nan")
            sections.append(
                f"<section><h2>task {html.escape(task_id)} "
                f'<span class="kv">{len(members)} trajectories, mean reward {_fmt(group_mean)}'
                f"</span></h2>"
                + "".join(_trajectory_html(i, r, scale) for i, r in visible)
                + "</section>"
            )
    else:
        missing = float("-inf") if sort == "reward" else float("inf")
        ordered = sorted(
            kept,
            key=lambda ir: ir[1]["reward"] if ir[1].get("reward") is not None else missing,
            reverse=sort == "reward",
        )
        order = "highest" if sort == "reward" else "lowest"
        sections.append(
            f"<section><h2>all trajectories, {order} reward first</h2>"
            + "".join(_trajectory_html(i, r, scale) for i, r in ordered)
            + "</section>"
        )
    bounds = [
        f"reward &ge; {_fmt(min_reward)}" if min_reward is not None else "",
        f"reward &le; {_fmt(max_reward)}" if max_reward is not None else "",
    ]
    bound_text = " and ".join(b for b in bounds if b)
    filtered = (
        f'<p class="kv">showing {len(kept)} of {len(rows)} trajectories ({bound_text})</p>'
        if bound_text
        else ""
    )
    legend = (
        '<p class="legend toks"><span class="lg pol" style="background:rgba(0,170,60,.6)">'
        'advantage &gt; 0</span><span class="lg pol" style="background:rgba(220,30,30,.6)">'
        'advantage &lt; 0</span><span class="lg pol adv-0">advantage 0</span>'
        '<span class="lg msk">masked (no gradient)</span> colour strength: |advantage| / '
        f"{_fmt(scale)} (step max); hover a token for id, logprob, advantage</p>"
    )
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{title}</title><style>{_CSS}</style></head><body>"
        f"{_step_links(steps, step)}"
        f"<h1>{title}</h1><p>{len(rows)} trajectories in {len(groups)} groups · "
        f"mean reward {_fmt(mean)} · steps saved: {html.escape(_steps_text(steps))}</p>"
        f"{legend}{filtered}{''.join(sections)}</body></html>\n"
    )
    target = Path(out) if out is not None else run_dir / "inspect" / f"step_{step:06d}.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    return target


def render_all(
    run_dir: Path,
    out_dir: Path | None = None,
    *,
    sort: Sort = "group",
    min_reward: float | None = None,
    max_reward: float | None = None,
) -> list[Path]:
    """Every saved step's page into `out_dir` (default RUN_DIR/inspect/), so the prev/next links
    between them all resolve."""
    folder = Path(out_dir) if out_dir is not None else Path(run_dir) / "inspect"
    steps = available_steps(run_dir) or [None]  # type: ignore[list-item]  # None: render_html says why
    return [
        render_html(
            run_dir,
            step,
            None if step is None else folder / f"step_{step:06d}.html",
            sort=sort,
            min_reward=min_reward,
            max_reward=max_reward,
        )
        for step in steps
    ]


def mask_runs(tokens: Sequence[str], mask: Sequence[int]) -> list[tuple[str, bool]]:
    """Consecutive tokens of the same mask joined: (text, trained) runs in order."""
    runs: list[tuple[str, bool]] = []
    for text, m in zip(tokens, mask, strict=True):
        if runs and runs[-1][1] == bool(m):
            runs[-1] = (runs[-1][0] + text, bool(m))
        else:
            runs.append((text, bool(m)))
    return runs


TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"


def marked_text(tokens: Sequence[str], mask: Sequence[int], colour: bool = False) -> str:
    """Token texts joined for a terminal: trained runs (policy_mask 1) in [[...]] (or green with
    `colour`), masked ones as they are (or dim grey)."""
    out = []
    for text, trained in mask_runs(tokens, mask):
        if colour:
            out.append(f"\x1b[1;32m{text}\x1b[0m" if trained else f"\x1b[2;37m{text}\x1b[0m")
        else:
            out.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained else text)
    return "".join(out)
