"""`rlvr eval`: load a model or a run's last checkpoint, score it on a task's held-out split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlvr.build import build_generator, rollout_limits
from rlvr.config import (
    RunConfig,
    _format_validation_error,
    apply_overrides,
    config_to_dict,
    load_config,
)
from rlvr.errors import ConfigError
from rlvr.evaluate import describe_errors, evaluate_sources, refuse_if_all_failed
from rlvr.models import Policy, load_policy, load_tokenizer
from rlvr.train.checkpoint import latest_checkpoint
from rlvr.train.sources import Sources


def _load_from_run(run_dir: Path) -> tuple[Policy, RunConfig]:
    cfg = load_config(run_dir / "config.yaml")
    model_dir = latest_checkpoint(run_dir) / "model"
    if (model_dir / "adapter_config.json").exists():
        from peft import PeftModel

        base = load_policy(cfg.model.name, device=cfg.model.device)
        model = PeftModel.from_pretrained(base.model, str(model_dir))
        return Policy(model=model, tokenizer=base.tokenizer, lora=True), cfg
    policy = load_policy(str(model_dir), device=cfg.model.device)
    policy.tokenizer = load_tokenizer(str(model_dir))
    return policy, cfg


def is_run_dir(model: str) -> bool:
    path = Path(model)
    return path.is_dir() and (path / "config.yaml").exists()


def load_model(model: str) -> tuple[Policy, RunConfig]:
    """`model` as `rlvr eval` takes it: a RUN_DIR (its last checkpoint, LoRA adapters applied, and
    its config) or an alias / model dir / hub id (with the default config)."""
    if is_run_dir(model):
        return _load_from_run(Path(model))
    return load_policy(model), load_config(None)


def with_task(
    cfg: RunConfig, task: str | None, overrides: list[str] | None = None
) -> tuple[RunConfig, Path | None]:
    """`cfg` with its tasks (task, rewards, mixture, eval metric) replaced as `--task` says:
    arithmetic, env:NAME, or a config .yaml (whose rollout and sampling come too). None keeps the
    run's own tasks. `overrides` (`--set key=value`) then apply to the result, e.g.
    `task.env.num_heldout=20` or `task.env.options.size=3`. Returns the config and the directory
    its reward files are relative to."""
    base_dir = None
    swap: RunConfig | None = None
    if task is None:
        pass
    elif task.endswith((".yaml", ".yml")):
        swap, base_dir = load_config(task), Path(task).parent
    elif task == "arithmetic":
        swap = load_config(None)
    elif task.startswith("env:"):
        # Eval reads only the held-out split, which does not depend on num_train (instances are
        # held out by a hash of their id): one train instance spares a small family from
        # failing to find 2000 distinct ones.
        swap = load_config(
            None, ["task.source=env", f"task.env.name={task[4:]}", "task.env.num_train=1"]
        )
    else:
        raise ConfigError(
            f"--task '{task}': expected arithmetic, env:NAME or a config .yaml whose tasks to use"
        )
    if swap is not None:
        update: dict[str, Any] = {
            "task": swap.task,
            "rewards": swap.rewards,
            "mixture": swap.mixture,
            # The run's accuracy metric names one of its own rewards; the new tasks bring theirs.
            "eval": cfg.eval.model_copy(update={"metric": swap.eval.metric}),
        }
        if task is not None and task.endswith((".yaml", ".yml")):
            update |= {"rollout": swap.rollout, "sampling": swap.sampling}
        cfg = cfg.model_copy(update=update)
    if overrides:
        data = apply_overrides(config_to_dict(cfg), overrides, RunConfig)
        try:
            cfg = RunConfig.model_validate(data)
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err, "--set")) from None
    return cfg, base_dir


def run_eval(
    model: str,
    *,
    task: str | None,
    n: int,
    k: int,
    max_new_tokens: int | None,
    temperature: float,
    overrides: list[str] | None = None,
) -> dict[str, float]:
    """Defaults (token limit, stop strings, metric, rollout limits) come from the run's config."""
    policy, cfg = load_model(model)
    cfg, base_dir = with_task(cfg, task, overrides)
    limit = max_new_tokens or cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens
    sources = Sources(cfg, base_dir)
    generator = build_generator(policy, cfg)
    common: dict[str, Any] = {
        "n": n,
        "max_new_tokens": limit,
        "stop": tuple(cfg.sampling.stop),
        "limits": rollout_limits(cfg),
    }
    failures: list[str] = []
    results = evaluate_sources(sources, generator, policy.tokenizer, failures=failures, **common)
    if k > 1:
        sampled = evaluate_sources(
            sources, generator, policy.tokenizer, k=k, temperature=temperature, **common
        )
        results[f"eval/mean@{k}"] = sampled["eval/accuracy"]
        if "eval/pass@k" in sampled:
            results[f"eval/pass@{k}"] = sampled["eval/pass@k"]
    n_tasks = sum(min(n, len(s.splits.heldout)) for s in sources)
    table = Table(title=f"{model} on {task or 'its tasks'} held-out ({n_tasks} tasks)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("pass@1 (greedy)", f"{results['eval/accuracy']:.1%}")
    if k > 1:
        table.add_row(f"mean@{k}", f"{results[f'eval/mean@{k}']:.1%}")
        if f"eval/pass@{k}" in results:
            table.add_row(f"pass@{k}", f"{results[f'eval/pass@{k}']:.1%}")
    if "eval/tool_call_rate" in results:
        table.add_row("tool-call rate", f"{results['eval/tool_call_rate']:.1%}")
    if "eval/mean_length" in results:
        table.add_row("mean completion tokens", f"{results['eval/mean_length']:.1f}")
    # Failed rollouts count as wrong in pass@1: how many there were is part of the result.
    for kind, label in (
        ("reward", "reward errors"),
        ("env", "env errors"),
        ("tool", "failed tool calls"),
    ):
        table.add_row(label, f"{int(results.get(f'eval/errors/{kind}', 0))}")
    Console().print(table)
    print(json.dumps(results))
    errored = describe_errors(results)
    if errored:
        example = f"; e.g. {failures[0]}" if failures else ""
        Console(stderr=True).print(
            f"[bold yellow]warning[/]: {escape(errored + example)}", soft_wrap=True
        )
    refuse_if_all_failed(results, failures, f"rlvr eval {model}")
    return results
