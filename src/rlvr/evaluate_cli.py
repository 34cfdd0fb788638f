"""`rlvr eval`: load a model or a run's last checkpoint, score it on a task's held-out split."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rlvr.build import build_generator, build_rubric
from rlvr.config import RunConfig, load_config
from rlvr.errors import ConfigError
from rlvr.evaluate import evaluate
from rlvr.models import Policy, load_policy, load_tokenizer
from rlvr.tasks import load_tasks
from rlvr.train.checkpoint import latest_checkpoint


def _load_from_run(run_dir: Path) -> tuple[Policy, RunConfig]:
    cfg = load_config(run_dir / "config.yaml")
    model_dir = latest_checkpoint(run_dir) / "model"
    if (model_dir / "adapter_config.json").exists():
        from peft import PeftModel

        base = load_policy(cfg.model.name)
        model = PeftModel.from_pretrained(base.model, str(model_dir))
        return Policy(model=model, tokenizer=base.tokenizer, lora=True), cfg
    policy = load_policy(str(model_dir))
    policy.tokenizer = load_tokenizer(str(model_dir))
    return policy, cfg


def run_eval(
    model: str, *, task: str, n: int, k: int, max_new_tokens: int | None, temperature: float
) -> dict[str, float]:
    """Defaults (token limit, stop strings, metric) come from the run's config, as in training."""
    path = Path(model)
    cfg: RunConfig
    if path.is_dir() and (path / "config.yaml").exists():
        policy, cfg = _load_from_run(path)
    else:
        policy, cfg = load_policy(model), load_config(None)
    base_dir = None
    if task.endswith((".yaml", ".yml")):
        task_cfg = load_config(task)
        base_dir = Path(task).parent
        cfg = cfg.model_copy(update={"task": task_cfg.task, "rewards": task_cfg.rewards})
    elif task != "arithmetic" and task != cfg.task.source:
        raise ConfigError(
            f"--task '{task}': expected 'arithmetic' or a config .yaml whose task section to use"
        )
    rubric = build_rubric(cfg.rewards, base_dir=base_dir)
    limit = max_new_tokens or cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens
    stop = tuple(cfg.sampling.stop)
    metric = cfg.eval.metric or rubric.names[0]
    tasks = load_tasks(cfg.task).heldout[:n]
    generator = build_generator(policy, cfg)
    results = evaluate(
        tasks, generator, policy.tokenizer, rubric, metric=metric, max_new_tokens=limit, stop=stop
    )
    if k > 1:
        sampled = evaluate(
            tasks,
            generator,
            policy.tokenizer,
            rubric,
            metric=metric,
            max_new_tokens=limit,
            stop=stop,
            k=k,
            temperature=temperature,
        )
        results[f"eval/mean@{k}"] = sampled["eval/accuracy"]
        results[f"eval/pass@{k}"] = sampled["eval/pass@k"]
    table = Table(title=f"{model} on {task} held-out ({len(tasks)} tasks)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("pass@1 (greedy)", f"{results['eval/accuracy']:.1%}")
    if k > 1:
        table.add_row(f"mean@{k}", f"{results[f'eval/mean@{k}']:.1%}")
        table.add_row(f"pass@{k}", f"{results[f'eval/pass@{k}']:.1%}")
    table.add_row("mean completion tokens", f"{results['eval/mean_length']:.1f}")
    table.add_row("verifier errors", f"{int(results['eval/errors'])}")
    Console().print(table)
    print(json.dumps(results))
    return results
