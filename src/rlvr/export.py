"""`rlvr export RUN_DIR OUT`: a run's policy as a model folder others can load and serve.

OUT is a standard Hugging Face model directory: safetensors weights, the tokenizer with the chat
template the run trained under (rlvr's ChatML fallback included, when the base had none), and a
generation_config.json whose eos ids are the ones rlvr stopped sampling on, so `transformers` and
`vllm serve OUT` end a reply where training did. A LoRA run is exported as a PEFT adapter folder
(adapter_config.json + adapter_model.safetensors, base_model_name_or_path = the run's base) unless
`merge_lora`, which folds the adapters into the base weights. README.md is a model card written
from the run's own files: its config, metrics.jsonl (held-out results before/after, alerts the
monitors raised) and the rlvr version.
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml

from rlvr.config import RunConfig, load_config
from rlvr.errors import ConfigError
from rlvr.train.checkpoint import checkpoint_dirs

# The settings a reader of the card needs to reproduce or judge the run, by config section.
_KEY_SETTINGS = {
    "objective": (
        "beta",
        "kl_estimator",
        "epsilon",
        "epsilon_high",
        "loss_aggregation",
        "scale_rewards",
        "num_iterations",
    ),
    "sampling": ("group_size", "prompts_per_step", "temperature", "top_p", "max_new_tokens"),
    "train": ("steps", "learning_rate", "lr_schedule", "warmup_steps", "max_grad_norm", "seed"),
}


def rlvr_version() -> str:
    try:
        return version("rlvr")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def pick_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of `step`, or the run's last one; errors name the steps there are."""
    found = checkpoint_dirs(run_dir)
    if not found:
        raise ConfigError(f"'{run_dir}' has no checkpoints (checkpoints/step-N): nothing to export")
    if step is None:
        return found[-1]
    for checkpoint in found:
        if int(checkpoint.name.removeprefix("step-")) == step:
            return checkpoint
    steps = ", ".join(str(int(c.name.removeprefix("step-"))) for c in found)
    raise ConfigError(
        f"--step {step}: '{run_dir}' has no checkpoint of that step (it has: {steps})"
    )


# `--dtype` choices: the weights are kept as trained (fp32 master weights here) unless asked.
EXPORT_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def export_run(
    run_dir: Path,
    out: Path,
    *,
    step: int | None = None,
    merge_lora: bool = False,
    dtype: str | None = None,
) -> Path:
    """Write the policy of `run_dir` (its checkpoint of `step`, default the last) to `out`;
    `dtype` casts the weights (half the size in bf16, at the cost of rounding small updates)."""
    from rlvr.models import eos_token_ids, load_policy, load_tokenizer

    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"'{run_dir}' is not a run directory (no config.yaml)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export target '{out}' exists and is not empty; choose a new folder")
    cfg = load_config(run_dir / "config.yaml")
    checkpoint = pick_checkpoint(run_dir, step)
    model_dir = checkpoint / "model"
    is_lora = (model_dir / "adapter_config.json").is_file()
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    if merge_lora and not is_lora:
        raise ConfigError(f"--merge-lora: '{run_dir}' trained all weights, not LoRA adapters")
    tokenizer = load_tokenizer(str(model_dir))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if is_lora:
        from peft import PeftModel

        base = load_policy(cfg.model.name, device=cfg.model.device)
        peft_model = PeftModel.from_pretrained(base.model, str(model_dir))
        model: Any = peft_model.merge_and_unload() if merge_lora else peft_model
    else:
        model = load_policy(str(model_dir), device=cfg.model.device).model
    if dtype is not None:
        import torch

        model = model.to(getattr(torch, EXPORT_DTYPES[dtype]))
    # Sampling stopped on these ids in training; the exported model must stop on them too.
    generation = model.generation_config
    generation.eos_token_id = sorted(eos_token_ids(model, tokenizer))
    generation.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    if is_lora and not merge_lora:
        generation.save_pretrained(tmp)  # peft saves only the adapter
        _point_adapter_at_base(tmp, cfg.model.name)
    tokenizer.save_pretrained(tmp)
    (tmp / "README.md").write_text(model_card(run_dir, cfg, checkpoint, is_lora, merge_lora))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _point_adapter_at_base(folder: Path, base_name: str) -> None:
    """adapter_config.json names the base by what the run loaded (an alias resolved to a path)."""
    from rlvr.models import resolve_model_path

    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = str(resolve_model_path(base_name))
    path.write_text(json.dumps(config, indent=2))


def _read_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _data_description(cfg: RunConfig) -> list[str]:
    lines = []
    for component in cfg.components():
        task = component.task
        if task.source == "dataset" and task.dataset is not None:
            what = f"dataset `{task.dataset.path}` (split {task.dataset.split})"
        elif task.source == "env" and task.env is not None:
            what = f"env `{task.env.name}` options {task.env.options or '{}'}"
        else:
            a = task.arithmetic
            what = f"arithmetic, {a.digits}-digit operands, operations {' '.join(a.operations)}"
        prefix = f"{component.name}: " if cfg.mixture else ""
        rewards = ", ".join(
            f"`{r.name or r.fn.rsplit(':', 1)[-1]}` ({r.fn}, weight {r.weight:g})"
            for r in component.rewards
        )
        lines.append(f"- {prefix}{what}; rewards: {rewards or 'the env’s own'}")
    return lines


# Bookkeeping, not results: counted in the note under the table instead.
_NOT_RESULTS = ("eval/n", "eval/rollouts", "eval/errors")


def _results_table(rows: list[dict[str, Any]], step: int, metric: str) -> list[str]:
    from rlvr.train.run_dir import eval_history

    history = [(s, ev) for s, ev in eval_history(rows) if s <= step]
    if not history:
        return ["No held-out evaluation was recorded up to this step."]
    (first_step, before), (last_step, after) = history[0], history[-1]
    keys = sorted(
        k for k in after if isinstance(after[k], int | float) and not k.startswith(_NOT_RESULTS)
    )
    lines = [f"| metric | step {first_step} | step {last_step} |", "| --- | --- | --- |"]
    for key in keys:
        old = before.get(key)
        lines.append(f"| {key} | {_number(old)} | {_number(after[key])} |")
    n = after.get("eval/n")
    lines.append("")
    lines.append(
        f"eval/accuracy is the mean of reward `{metric}` on "
        + (f"the first {int(n)} held-out tasks" if n is not None else "the held-out tasks")
        + ", greedy decoding."
    )
    failed = [(s, int(ev.get("eval/errors", 0))) for s, ev in (history[0], history[-1])]
    if any(count for _, count in failed):
        lines.append(
            "Rollouts that could not be scored (counted as wrong): "
            + ", ".join(f"step {s}: {count}" for s, count in failed)
        )
    return lines


def _metric_name(cfg: RunConfig) -> str:
    """The reward component eval/accuracy reads: eval.metric, else the first reward's name."""
    if cfg.eval.metric:
        return cfg.eval.metric
    rewards = cfg.components()[0].rewards
    if rewards:
        return rewards[0].name or rewards[0].fn.rsplit(":", 1)[-1]
    return "success (the env's)"


def _number(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"


def _alerts(rows: list[dict[str, Any]], step: int) -> list[str]:
    fired = [r for r in rows if "event" in r and int(r.get("step", 0)) <= step]
    if not fired:
        return ["None fired."]
    return [
        f"- step {r.get('step')}: **{r['event']}** ({r.get('action', 'warn')}): {r.get('message', '')}"
        for r in fired
    ]


def model_card(run_dir: Path, cfg: RunConfig, checkpoint: Path, is_lora: bool, merged: bool) -> str:
    """README.md for the export: what was trained, how, on what, with what result."""
    from rlvr.models import resolve_model_path

    step = int(checkpoint.name.removeprefix("step-"))
    rows = _read_rows(run_dir)
    base = cfg.model.name
    loaded_from = str(resolve_model_path(base))
    kind = "PEFT LoRA adapter" if is_lora and not merged else "model"
    if is_lora and merged:
        kind = "model (LoRA adapters merged into the base weights)"
    front = {
        "base_model": base,
        "library_name": "peft" if is_lora and not merged else "transformers",
        "tags": ["rlvr", cfg.algorithm, "reinforcement-learning"],
    }
    settings = [f"- algorithm: `{cfg.algorithm}`"]
    data = cfg.model_dump(mode="json")
    for section, keys in _KEY_SETTINGS.items():
        shown = ", ".join(f"{k} {data[section][k]}" for k in keys if k in data[section])
        settings.append(f"- {section}: {shown}")
    if cfg.model.lora.enabled:
        lora = cfg.model.lora
        settings.append(f"- LoRA: r {lora.r}, alpha {lora.alpha}, targets {lora.target_modules}")
    config_text = (run_dir / "config.yaml").read_text()
    use = (
        f'PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{loaded_from}"), "OUT")'
        if is_lora and not merged
        else 'AutoModelForCausalLM.from_pretrained("OUT")'
    )
    serve = (
        f"vllm serve {loaded_from} --enable-lora --lora-modules policy=OUT"
        if is_lora and not merged
        else "vllm serve OUT"
    )
    parts = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {run_dir.resolve().name}, step {step}",
        "",
        f"A {kind} trained with rlvr {rlvr_version()} by reinforcement learning from verifiable "
        f"rewards, exported from `{run_dir}` (checkpoint step {step}).",
        "",
        f"- base model: `{base}`"
        + (f" (loaded from `{loaded_from}`)" if loaded_from != base else ""),
        "",
        "## Training",
        "",
        *settings,
        "",
        "## Data",
        "",
        *_data_description(cfg),
        "",
        "## Held-out results",
        "",
        *_results_table(rows, step, _metric_name(cfg)),
        "",
        "## Monitors that fired",
        "",
        *_alerts(rows, step),
        "",
        "## Use",
        "",
        f"- transformers (OUT = this folder): `{use}`; prompts go through the tokenizer's chat template "
        "(`apply_chat_template`), as in training.",
        f"- vLLM: `{serve}`",
        "",
        "## rlvr config",
        "",
        "```yaml",
        config_text.rstrip(),
        "```",
        "",
    ]
    return "\n".join(parts)
