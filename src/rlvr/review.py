"""`rlvr review CKPT --baseline BASE`: a launch review of a trained model against the model it came from.
(The sycophancy probes and their decision rule are in rlvr.sycophancy.)

For each of the two models, on the same held-out tasks and the same probes:
- verifier correctness: greedy pass@1 on the task's held-out split, scored by the task's own verifier
  (`rlvr.evaluate`, exactly as `rlvr eval` does);
- mean completion tokens of those greedy answers;
- sycophancy rate on a probe set (`review_probes.json`, or `--probes FILE.jsonl`): questions with a
  known answer asked in two multi-turn forms, the user asserting a wrong answer ("assert_wrong") or
  pushing back on a right one ("push_back"); the rate is the share of decided replies that give the
  user's wrong answer;
and, once, KL(model || baseline) on held-out prompts: k completions per prompt sampled from the model at
temperature 1, each scored under both models by the trainer's forward pass (`token_logprobs`); the mean
over sequences of sum_t (log p_model - log p_base) (the k1 estimator summed over a sequence) is an
unbiased estimate of the sequence-level KL. The per-token figure divides the same sum by the token count.

What it is not: the KL covers the policy's own tokens only (prompts, observations and template glue are
masked as in training), and it is measured under the model's chat template (the baseline's may differ).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from rlvr.algorithms.losses import kl_k1, kl_k3
from rlvr.build import build_generator, rollout_limits
from rlvr.config import RunConfig
from rlvr.devices import device_of
from rlvr.errors import ConfigError
from rlvr.evaluate import evaluate_sources
from rlvr.evaluate_cli import is_run_dir, load_model, with_task
from rlvr.models import Policy
from rlvr.records import Trajectory, flatten
from rlvr.rollout.engine import RolloutLimits, rollout_groups
from rlvr.rollout.generator import Generator, SamplingParams
from rlvr.sycophancy import Probe, load_probes, reply_fn, sycophancy
from rlvr.train.batch import collate, token_logprobs
from rlvr.train.sources import Sources

# The number syntax `numeric_match` reads (signs, thousands commas, decimals), so probes and the task
# verifier agree on what a number in a reply is.


# ---------------------------------------------------------------------------------------------- KL
def sample_heldout(
    sources: Sources,
    generator: Generator,
    tokenizer: Any,
    *,
    n: int,
    k: int,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    limits: RolloutLimits | None = None,
) -> list[Trajectory]:
    """k temperature-1 samples per held-out prompt (first `n` of each source), played as in eval."""
    sampling = SamplingParams(n=k, temperature=1.0, max_new_tokens=max_new_tokens, stop=stop)
    if limits is not None and limits.max_total_tokens < max_new_tokens:
        limits = dataclasses.replace(limits, max_total_tokens=max_new_tokens)
    out: list[Trajectory] = []
    for source in sources:
        groups = rollout_groups(
            source.splits.heldout[:n],
            source.make_env,
            generator,
            tokenizer,
            sampling,
            source.scoring,
            limits,
        )
        out += flatten(groups)
    return out


@torch.no_grad()
def kl_estimate(
    model: Any,
    baseline: Any,
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    micro_batch: int = 16,
) -> dict[str, float]:
    """KL(model || baseline) from `trajectories` sampled from `model` (temperature 1).

    Per sequence: sum over its policy tokens of log p_model - log p_base (k1), averaged over sequences:
    unbiased for the sequence-level KL, can come out slightly negative on few samples. Per token: the
    same sum over all sequences / all policy tokens. `kl/k3_token` (Schulman's k3, >= 0, low variance)
    is a cross-check of the per-token figure. Both models run in fp32 through the trainer's path.
    """
    if not trajectories:
        raise ConfigError("no samples to estimate the KL on (empty held-out split)")
    seq_k1: list[float] = []
    tokens = 0.0
    k3_total = 0.0
    for start in range(0, len(trajectories), micro_batch):
        chunk = trajectories[start : start + micro_batch]
        zeros = [[0.0] * len(t.completion_ids) for t in chunk]
        batch = collate(chunk, zeros, pad_token_id, device_of(model))
        logprobs_B_C, _ = token_logprobs(model, batch)
        base_logprobs_B_C, _ = token_logprobs(baseline, batch)
        mask_B_C = batch.mask_B_C
        seq_k1 += (kl_k1(logprobs_B_C, base_logprobs_B_C) * mask_B_C).sum(dim=1).tolist()
        k3_total += float((kl_k3(logprobs_B_C, base_logprobs_B_C) * mask_B_C).sum())
        tokens += float(mask_B_C.sum())
    n = len(seq_k1)
    return {
        "kl/seq": statistics.fmean(seq_k1),
        "kl/seq_stderr": statistics.stdev(seq_k1) / math.sqrt(n) if n > 1 else 0.0,
        "kl/token": sum(seq_k1) / max(tokens, 1.0),
        "kl/k3_token": k3_total / max(tokens, 1.0),
        "kl/samples": float(n),
        "kl/tokens": tokens,
    }


def check_same_tokenizer(a: Any, b: Any) -> None:
    """KL compares log-probs of the same token ids: the two vocabularies must be identical."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        detail = (
            f"{len(va)} vs {len(vb)} tokens" if len(va) != len(vb) else "same size, different ids"
        )
        raise ConfigError(
            f"model and baseline use different tokenizers ({detail}): the KL needs a shared one"
        )


# ---------------------------------------------------------------------------------------------- review
# (key, label, kind) of each row; kind picks the formatting.
def _rows_spec(categories: Sequence[str], num_probes: int) -> list[tuple[str, str, str]]:
    rows = [
        ("pass@1", "verifier pass@1 (greedy, held-out)", "rate"),
        ("mean_length", "mean completion tokens", "tokens"),
        ("sycophancy", "sycophancy rate, all probes", "rate"),
        ("sycophancy/assert_wrong", "sycophancy: user asserts wrong", "rate"),
        ("sycophancy/push_back", "sycophancy: user pushes back", "rate"),
    ]
    rows += [(f"sycophancy/category/{c}", f"sycophancy: {c} probes", "rate") for c in categories]
    rows.append(("probes_decided", f"probe replies decided (of {2 * num_probes})", "count"))
    return rows


def _model_metrics(ev: Mapping[str, float], syc: Mapping[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        "pass@1": ev["eval/accuracy"],
        "mean_length": ev.get("eval/mean_length"),
        "sycophancy": syc["rate"],
        "probes_decided": float(syc["decided"]),
    }
    out |= {f"sycophancy/{f}": s["rate"] for f, s in syc["by_form"].items()}
    out |= {f"sycophancy/category/{c}": s["rate"] for c, s in syc["by_category"].items()}
    return out


def _fmt(value: float | None, kind: str, delta: bool = False) -> str:
    if value is None:
        return "—"
    if kind == "rate":
        return f"{100 * value:+.1f} pp" if delta else f"{value:.1%}"
    if kind == "nats":
        return f"{value:+.4f}" if delta else f"{value:.4f}"
    if kind == "count":
        return f"{value:+.0f}" if delta else f"{value:.0f}"
    return f"{value:+.1f}" if delta else f"{value:.1f}"


def _table_rows(report: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(label, baseline, model, delta) strings, shared by the screen table and review.md."""
    out = []
    for row in report["rows"]:
        out.append(
            (
                row["label"],
                _fmt(row["baseline"], row["kind"]),
                _fmt(row["model"], row["kind"]),
                _fmt(row["delta"], row["kind"], delta=True),
            )
        )
    kl = report["kl"]
    out.append(
        (
            "KL from baseline per sequence, nats",
            "—",
            f"{kl['kl/seq']:.4f} ± {kl['kl/seq_stderr']:.4f}",
            "—",
        )
    )
    out.append(
        (
            "KL from baseline per token, k1 (k3)",
            "—",
            f"{kl['kl/token']:.5f} ({kl['kl/k3_token']:.5f})",
            "—",
        )
    )
    return out


def _task_label(cfg: RunConfig, task: str | None) -> str:
    if task is not None:
        return task
    if cfg.mixture:
        return "mixture: " + ", ".join(c.name for c in cfg.mixture)
    if cfg.task.source == "env" and cfg.task.env is not None:
        return f"env:{cfg.task.env.name}"
    if cfg.task.source == "dataset" and cfg.task.dataset is not None:
        return f"dataset:{cfg.task.dataset.path}"
    return "arithmetic"


def render_markdown(report: Mapping[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"# Review: `{report['model']}` vs baseline `{report['baseline']}`",
        "",
        f"{report['date']}. Task: {report['task']}, {s['heldout_tasks']} held-out tasks; "
        f"{s['num_probes']} sycophancy probes ({s['probes']}); KL from {s['kl_samples_per_prompt']} "
        f"samples per held-out prompt at temperature 1. {report['runtime_s']:.0f} s.",
        "",
        "| metric | baseline | model | delta |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
        for row in _table_rows(report)
    ]
    lines += [
        "",
        "- pass@1: share of held-out tasks the task's verifier scores correct, greedy decoding.",
        "- sycophancy: share of decided probe replies whose final answer is the user's wrong one "
        "(see docs/review.md for the decision rule); lower is better.",
        "- KL: nats by which the model's samples are likelier under the model than under the baseline "
        "(unbiased k1 estimate, ± one standard error).",
    ]
    gave_in = [r for r in report["sycophancy"]["model"]["records"] if r["verdict"] == "gave_in"]
    if gave_in:
        lines += ["", "## Where the model gave in (first 5)", ""]
        for r in gave_in[:5]:
            reply = " ".join(r["reply"].split())[:240]
            lines += [f"- `{r['id']}` {r['form']}: user: {r['user']}", f"  > {reply}"]
    return "\n".join(lines) + "\n"


def print_table(report: Mapping[str, Any], console: Console | None = None) -> None:
    table = Table(
        title=f"review: {report['model']} vs {report['baseline']} on {report['task']} "
        f"({report['settings']['heldout_tasks']} held-out tasks, "
        f"{report['settings']['num_probes']} probes)"
    )
    table.add_column("metric")
    for name in ("baseline", "model", "delta"):
        table.add_column(name, justify="right")
    for row in _table_rows(report):
        table.add_row(*row)
    (console or Console()).print(table)


def default_out_dir(model: str) -> Path:
    """The model's run directory when it is one, else ./review-<model name>/."""
    if is_run_dir(model):
        return Path(model)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model.rstrip("/")).name).strip("-.") or "model"
    return Path(f"review-{name}")


def _probe_model(
    policy: Policy,
    cfg: RunConfig,
    sources: Sources,
    probes: Sequence[Probe],
    *,
    n: int,
    limit: int,
    probe_max_new_tokens: int,
) -> tuple[dict[str, float], dict[str, Any]]:
    generator = build_generator(policy, cfg)
    ev = evaluate_sources(
        sources,
        generator,
        policy.tokenizer,
        n=n,
        max_new_tokens=limit,
        stop=tuple(cfg.sampling.stop),
        limits=rollout_limits(cfg),
    )
    syc = sycophancy(probes, reply_fn(generator, policy.tokenizer, probe_max_new_tokens))
    return ev, syc


def review(
    model: str,
    baseline: str,
    task: str | None,
    *,
    n: int,
    out_dir: Path | None,
    probes_file: str | Path | None = None,
    kl_samples: int = 4,
    max_new_tokens: int | None = None,
    probe_max_new_tokens: int = 40,
    console: Console | None = None,
) -> dict[str, Any]:
    """Review `model` against `baseline` (each an alias, model dir, hub id or RUN_DIR); print the
    table, write review.json and review.md to `out_dir` (None: `default_out_dir(model)`).

    Tasks, token limit, stop strings: `--task` over the model's run config, else the baseline's run
    config, else the default (arithmetic). Both models are scored under that one config.
    """
    if n < 1 or kl_samples < 1:
        raise ConfigError(f"--n and the KL samples per prompt must be >= 1 (got {n}, {kl_samples})")
    started = time.perf_counter()
    probes = load_probes(probes_file)
    policy, model_cfg = load_model(model)
    if baseline == model:
        base_policy, base_cfg = policy, model_cfg
    else:
        base_policy, base_cfg = load_model(baseline)
    check_same_tokenizer(policy.tokenizer, base_policy.tokenizer)
    tasks_cfg = base_cfg if is_run_dir(baseline) and not is_run_dir(model) else model_cfg
    cfg, base_dir = with_task(tasks_cfg, task)
    sources = Sources(cfg, base_dir)
    limit = max_new_tokens or cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens
    policy.model.eval()
    base_policy.model.eval()
    console = console or Console()
    timings: dict[str, float] = {"load": time.perf_counter() - started}

    def phase(name: str, begun: float) -> None:
        timings[name] = time.perf_counter() - begun
        console.print(f"[dim]{name}: {timings[name]:.0f} s[/dim]")

    common: dict[str, Any] = {"n": n, "limit": limit, "probe_max_new_tokens": probe_max_new_tokens}
    begun = time.perf_counter()
    ev_model, syc_model = _probe_model(policy, cfg, sources, probes, **common)
    phase("model: eval + probes", begun)
    if base_policy is policy:  # greedy decoding: the same model gives the same answers
        ev_base, syc_base = ev_model, syc_model
    else:
        begun = time.perf_counter()
        ev_base, syc_base = _probe_model(base_policy, cfg, sources, probes, **common)
        phase("baseline: eval + probes", begun)
    begun = time.perf_counter()
    samples = sample_heldout(
        sources,
        build_generator(policy, cfg),
        policy.tokenizer,
        n=n,
        k=kl_samples,
        max_new_tokens=limit,
        stop=tuple(cfg.sampling.stop),
        limits=rollout_limits(cfg),
    )
    kl = kl_estimate(policy.model, base_policy.model, samples, int(policy.tokenizer.pad_token_id))
    phase("KL", begun)

    metrics = {
        "model": _model_metrics(ev_model, syc_model),
        "baseline": _model_metrics(ev_base, syc_base),
    }
    categories = sorted({p.category for p in probes})
    rows = []
    for key, label, kind in _rows_spec(categories, len(probes)):
        m, b = metrics["model"].get(key), metrics["baseline"].get(key)
        delta = None if m is None or b is None else m - b
        rows.append(
            {
                "metric": key,
                "label": label,
                "kind": kind,
                "baseline": b,
                "model": m,
                "delta": delta,
            }
        )
    report: dict[str, Any] = {
        "model": model,
        "baseline": baseline,
        "task": _task_label(cfg, task),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {
            "n": n,
            "heldout_tasks": sum(min(n, len(s.splits.heldout)) for s in sources),
            "kl_samples_per_prompt": kl_samples,
            "max_new_tokens": limit,
            "probe_max_new_tokens": probe_max_new_tokens,
            "probes": str(probes_file) if probes_file is not None else "built-in",
            "num_probes": len(probes),
        },
        "metrics": metrics,
        "kl": kl,
        "rows": rows,
        "eval": {"model": ev_model, "baseline": ev_base},
        "sycophancy": {"model": syc_model, "baseline": syc_base},
        "runtime_s": time.perf_counter() - started,
        "timings_s": timings,
    }
    print_table(report, console)
    target = out_dir if out_dir is not None else default_out_dir(model)
    target.mkdir(parents=True, exist_ok=True)
    (target / "review.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (target / "review.md").write_text(render_markdown(report), encoding="utf-8")
    console.print(
        f"wrote {target / 'review.json'} and {target / 'review.md'} ({report['runtime_s']:.0f} s)"
    )
    return report


def review_command(
    model: str,
    baseline: str,
    task: str | None,
    n: int,
    probes: str | Path | None,
    out: str | Path | None,
) -> None:
    """Everything `rlvr review` does: load both models, measure, print the table, write the files."""
    review(
        model,
        baseline,
        task,
        n=n,
        out_dir=Path(out) if out is not None else None,
        probes_file=probes,
    )
