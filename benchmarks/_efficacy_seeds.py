"""Rows measured on several seeds (benchmarks/efficacy.py --seeds): which results form a row's
series, and the one row result the table shows for it (the mean over seeds, with each seed's
number kept for the spread).

A series is the newest result of a row and, for every other seed, the newest result measured the
same way: the same command but for its seed arguments (`--set train.seed=S`, and for a warm-up
row `--warmup-set train.seed=S`), from the same recipe (the row's overrides and config files), on
the same held-out instances and the same CPU. A result from before results
named their seed ran with the config's seed, 0, unless its command set one. The instance interval
of a multi-seed row is a paired bootstrap over instances of the per-instance mean over seeds: it
says how sure the mean is on these instances; the spread across seeds says how much one run
varies.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

import _efficacy_chance as chance_lib

SEED_ARGS = re.compile(r" --(?:set|warmup-set) train\.seed=-?\d+")
_RL_SEED = re.compile(r" --set train\.seed=(-?\d+)")


def seed_of(result: dict[str, Any]) -> int:
    """The RL run's seed: recorded, else read from the command, else the config default 0."""
    if "seed" in result:
        return int(result["seed"])
    found = _RL_SEED.search(result["command"])
    return int(found.group(1)) if found else 0


def series_key(result: dict[str, Any]) -> tuple[Any, ...]:
    """What results of one series share: the command without its seed, the held-out set, n, the
    CPU (minutes and steps in budget depend on it; the table names one CPU per row), and the row's
    recipe: its overrides and its config files' content (`config_sha`), since a row's command
    stays the same when its yaml or overrides change and its old seeds must not be averaged in."""
    return (SEED_ARGS.sub("", result["command"]), result.get("heldout_sha"), result["n"],
            result.get("cpu", ""), tuple(result.get("overrides", ())),
            result.get("config_sha"))  # fmt: skip


def newest_series(results: list[dict[str, Any]], row: str) -> list[dict[str, Any]]:
    """The row's newest result and the newest result of each other seed measured the same way,
    ordered by seed (`results` in file order, oldest first)."""
    mine = [r for r in results if r["row"] == row]
    if not mine:
        return []
    key = series_key(mine[-1])
    by_seed = {seed_of(r): r for r in mine if series_key(r) == key}
    return [by_seed[seed] for seed in sorted(by_seed)]


def _per_instance_mean(series: list[dict[str, Any]], field: str) -> list[float] | None:
    columns = [r["per_instance"].get(field) for r in series]
    if any(c is None for c in columns):
        return None
    return [statistics.fmean(values) for values in zip(*columns, strict=True)]


def _mean(series: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in series if r.get(field) is not None]
    return statistics.fmean(values) if len(values) == len(series) else None


def combine(series: list[dict[str, Any]], newest: dict[str, Any]) -> dict[str, Any]:
    """One result for the table from a series (one seed: that result as it is); `newest`, the
    series' most recent result, gives the fields that are not averaged (command, CPU, date).

    Per-instance results are averaged over seeds, so the gain intervals are over instances of
    the seed-mean; `train_minutes` is the slowest seed's (a time target must hold for every run);
    `seeds` keeps each seed's after and steps for the spread. Seeds whose results did not
    store per-instance scores on the same instances cannot be paired: then the newest alone."""
    ids = [r.get("per_instance", {}).get("ids") for r in series]
    if len(series) == 1 or any(i is None or i != ids[0] for i in ids):
        return {**newest, "seeds": [_seed_entry(newest)]}
    k = newest["k"]
    out = {**newest}
    before = _per_instance_mean(series, "before")
    after = _per_instance_mean(series, "after")
    assert before is not None and after is not None
    out["per_instance"] = {"ids": ids[0], "before": before, "after": after}
    out["before"], out["after"] = statistics.fmean(before), statistics.fmean(after)
    out["gain"] = out["after"] - out["before"]
    out["gain_ci95"] = list(chance_lib.bootstrap_gain(after, before, paired=True))
    warm = _per_instance_mean(series, "after_warmup")
    if warm is not None:
        out["per_instance"]["after_warmup"] = warm
        out["after_warmup"] = statistics.fmean(warm)
        out["rl_gain"] = out["after"] - out["after_warmup"]
        out["rl_gain_ci95"] = list(chance_lib.bootstrap_gain(after, warm, paired=True))
    placebo = _per_instance_mean(series, "after_placebo")
    if placebo is not None:  # every seed ran its placebo arm: RL over placebo over seed-means
        out["per_instance"]["after_placebo"] = placebo
        out["after_placebo"] = statistics.fmean(placebo)
        out["over_placebo"] = out["after"] - out["after_placebo"]
        out["over_placebo_ci95"] = list(chance_lib.bootstrap_gain(after, placebo, paired=True))
    else:
        for field in ("after_placebo", "over_placebo", "over_placebo_ci95"):
            out.pop(field, None)
    for field in (f"mean@{k}_before", f"mean@{k}_after", f"mean@{k}_after_warmup",
                  f"mean@{k}_after_placebo", "tool_call_rate_after", "turns_after"):  # fmt: skip
        mean = _mean(series, field)
        if mean is not None:  # else the newest's own value stands (an old result lacks it)
            out[field] = mean
    out["train_minutes"] = max(r["train_minutes"] for r in series)
    out["seeds"] = [_seed_entry(r) for r in series]
    out["command"] = (
        SEED_ARGS.sub("", newest["command"])
        + " --seeds "
        + " ".join(str(seed_of(r)) for r in series)
    )
    return out


def _seed_entry(result: dict[str, Any]) -> dict[str, Any]:
    return {"seed": seed_of(result), "after": result["after"], "steps": result["steps"]}


def spread_text(combined: dict[str, Any]) -> str:
    """The table's seed column: each seed's after (seed order) and their standard deviation."""
    seeds = combined.get("seeds") or []
    if len(seeds) < 2:
        return f"1 (seed {seeds[0]['seed']})" if seeds else ""
    afters = [s["after"] for s in seeds]
    each = " / ".join(f"{100 * a:.1f}" for a in afters)
    return (
        f"{len(seeds)} (seeds {', '.join(str(s['seed']) for s in seeds)}): {each}%; "
        f"sd {100 * statistics.stdev(afters):.1f} pts"
    )
