"""`rlvr pipeline CONFIG.yaml`: stages in order, each starting from the previous stage's model.

    SFT teaches format, DPO style, RL reasoning and tool use; distillation sits between SFT and RL.

A pipeline config names the first model, a run directory and a list of stages:

    model: smollm2-135m-instruct
    output_dir: runs/pipeline
    stages:
      - {name: sft, kind: sft, config: {data: {path: sft.jsonl}, train: {steps: 50}}}
      - {name: dpo, kind: dpo, config: {data: {path: pairs.jsonl}}}
      - {name: grpo, kind: rl, config: {algorithm: grpo, train: {steps: 30}}}    # any RunConfig

Each stage writes to OUTPUT_DIR/<name>/ and leaves its model in a plain HF directory that the next
policy stage starts from (`model.name` is filled in; setting it is an error, except with `from:`).
A `reward_model` stage's output is not a policy: the next stage continues from the one before it,
and a later stage points at it with the string `{stage:NAME}` anywhere in its config (e.g. the
`path` option of the `rlvr.offline.reward_model:reward_model` reward). `kind: distill` samples a
teacher (`teacher_data:`) and fine-tunes the student on the samples (SFT); on-policy distillation is
`kind: rl` with `algorithm: distill`.

An `sft` stage may train on demonstrations played in an env instead of a data file (a format
warm-up before RL, rlvr.authoring.demos): `env_demos: {episodes: 160, policy: random}` plays the first
RL stage's env on its train split (or `config: FILE.yaml`'s) and writes OUTPUT_DIR/<name>/demos.jsonl,
the stage's data. `policy: random` teaches the answer format only; `scripted` clones a solver.

Resumable: a finished stage (its DONE.json) is skipped, an interrupted one continues from its last
checkpoint. With `eval.each_stage` every policy stage's model is scored on the first RL stage's
held-out tasks, so the table shows what each stage bought.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from rlvr.config import RunConfig, _format_validation_error, _Section, apply_overrides
from rlvr.errors import ConfigError

DONE_FILE = "stage.json"  # the pipeline's own marker; offline trainers write DONE.json
_PLACEHOLDER = re.compile(r"\{stage:([A-Za-z0-9_.-]+)\}")


class StageSpec(_Section):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Sub-directory and label.")
    kind: Literal["sft", "dpo", "reward_model", "distill", "rl"]
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The stage's own config: a RunConfig (rl), SFTConfig (sft, distill), DPOConfig, "
        "RewardModelConfig; output_dir and model.name are filled in.",
    )
    file: str | None = Field(
        None, description="A YAML file with the stage config; `config` overrides it."
    )
    teacher_data: dict[str, Any] = Field(
        default_factory=dict,
        description="kind distill: the teacher sampling (rlvr.offline.config.DistillDataConfig).",
    )
    from_: str | None = Field(
        None,
        alias="from",
        description="Start from this stage's model instead of the previous policy.",
    )
    env_demos: dict[str, Any] = Field(
        default_factory=dict,
        description="kind sft: train on env demonstrations (rlvr.authoring.demos.EnvDemosConfig: "
        "episodes, policy random|scripted, seed, max_turns, config) instead of data.path.",
    )


class PipelineEval(_Section):
    each_stage: bool = Field(
        True,
        description="Score the start model and every policy stage on the first RL stage's tasks.",
    )
    n: int = Field(100, ge=1, description="Held-out tasks per evaluation (greedy pass@1).")


class PipelineConfig(_Section):
    model: str = Field("smollm2-135m-instruct", description="The first stage's starting model.")
    output_dir: str = Field("runs/pipeline", description="One sub-directory per stage.")
    stages: list[StageSpec] = Field(..., min_length=1)
    eval: PipelineEval = PipelineEval()

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError("stage names must be unique")
        for i, stage in enumerate(self.stages):
            earlier = names[:i]
            if stage.from_ is not None and stage.from_ not in earlier:
                raise ValueError(
                    f"stage '{stage.name}': from '{stage.from_}' is not an earlier stage"
                )
            for ref in _PLACEHOLDER.findall(json.dumps(stage.config)):
                if ref not in earlier:
                    raise ValueError(
                        f"stage '{stage.name}': {{stage:{ref}}} does not name an earlier stage"
                    )
            if "model" in stage.config and "name" in (stage.config.get("model") or {}):
                raise ValueError(
                    f"stage '{stage.name}': model.name is set by the pipeline (use `from:` to pick "
                    "another stage's model)"
                )
            if stage.kind == "distill" and not stage.teacher_data:
                raise ValueError(f"stage '{stage.name}': kind distill needs teacher_data")
            if stage.env_demos and stage.kind != "sft":
                raise ValueError(f"stage '{stage.name}': env_demos is for kind sft")
            if stage.env_demos and (stage.config.get("data") or {}).get("path"):
                raise ValueError(f"stage '{stage.name}': env_demos replaces data.path; set one")
        return self


def load_pipeline_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"pipeline config '{file}' does not exist")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{file}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a mapping (model, output_dir, stages)")
    data = apply_overrides(data, overrides or [], PipelineConfig)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, str(file))) from None


# ---------------------------------------------------------------------------------------------- running
def _substitute(value: Any, models: dict[str, Path]) -> Any:
    """Replace `{stage:NAME}` in every string of a config with that stage's model directory."""
    return _substitute_with(value, lambda name: str(models[name]))


def _substitute_with(value: Any, lookup: Any) -> Any:
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: lookup(m.group(1)), value)
    if isinstance(value, dict):
        return {k: _substitute_with(v, lookup) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute_with(v, lookup) for v in value]
    return value


def _stage_data(stage: StageSpec, base: Path) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if stage.file is not None:
        path = Path(stage.file) if Path(stage.file).is_absolute() else base / stage.file
        if not path.is_file():
            raise ConfigError(f"stage '{stage.name}': file '{path}' does not exist")
        data = yaml.safe_load(path.read_text()) or {}
    return _merge(data, stage.config)


def _merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    out = dict(low)
    for key, value in high.items():
        out[key] = (
            _merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def _absolute_data_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Offline stage configs name data files relative to the pipeline config's folder."""
    section = dict(data.get("data") or {})
    for key in ("path", "heldout_path"):
        value = section.get(key)
        if isinstance(value, str) and not Path(value).is_absolute() and (base / value).exists():
            section[key] = str((base / value).resolve())
    return {**data, "data": section} if section else data


def _rl_model_dir(run_dir: Path, cfg: RunConfig, stage_dir: Path) -> Path:
    """The RL stage's final policy as a plain HF directory (LoRA adapters merged into the base)."""
    from rlvr.train.checkpoint import latest_checkpoint

    model_dir = latest_checkpoint(run_dir) / "model"
    if not (model_dir / "adapter_config.json").exists():
        return model_dir
    from peft import PeftModel

    from rlvr.models import load_policy

    merged_dir = stage_dir / "model"
    if not (merged_dir / "config.json").exists():
        base = load_policy(cfg.model.name, device=cfg.model.device)
        merged = PeftModel.from_pretrained(base.model, str(model_dir)).merge_and_unload()
        merged.save_pretrained(merged_dir)
        base.tokenizer.save_pretrained(merged_dir)
    return merged_dir


def _run_stage(
    stage: StageSpec,
    start_model: Path | str,
    stage_dir: Path,
    base: Path,
    models: dict[str, Path],
    first_rl: RunConfig | None = None,
) -> tuple[Path, dict[str, float], RunConfig | None]:
    """Run one stage (resuming when it was interrupted); returns (model dir, final metrics, RL cfg).
    `first_rl`: the pipeline's first RL stage config, whose env an `env_demos` stage plays."""
    from rlvr.offline.common import StageResult

    data = _substitute(_stage_data(stage, base), models)
    model = {**(data.get("model") or {}), "name": str(start_model)}
    data = {**data, "model": model, "output_dir": str(stage_dir)}
    if stage.kind == "rl":
        from rlvr.config import RunConfig as _RunConfig
        from rlvr.train.checkpoint import checkpoint_dirs
        from rlvr.train.loop import train

        try:
            cfg = _RunConfig.model_validate(data)
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err, f"stage '{stage.name}'")) from None
        resume = bool(checkpoint_dirs(stage_dir))
        # An unfinished stage without a checkpoint starts over (its partial files moved aside).
        summary = train(cfg, resume=resume, overwrite=not resume, config_dir=base)
        if summary.stopped_early:
            # Not finished: no marker, so later stages do not build on it; a rerun resumes it.
            raise ConfigError(
                f"stage '{stage.name}' was stopped by a monitor at step {summary.steps_done} "
                f"({summary.stopped_early}); see rlvr report {stage_dir}"
            )
        metrics = dict(summary.eval_history[-1][1]) if summary.eval_history else {}
        return _rl_model_dir(stage_dir, cfg, stage_dir), metrics, cfg

    from rlvr.offline.config import (
        DistillDataConfig,
        DPOConfig,
        RewardModelConfig,
        SFTConfig,
    )

    def validated(cls: Any, payload: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(payload)
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err, f"stage '{stage.name}'")) from None

    data = _absolute_data_paths(data, base)
    result: StageResult
    demo_metrics: dict[str, float] = {}
    if stage.kind == "sft" and stage.env_demos:
        from rlvr.authoring.demos import EnvDemosConfig, demos_for_stage
        from rlvr.models import load_tokenizer, resolve_model_path

        demos_file = stage_dir / "demos.jsonl"
        demos = demos_for_stage(  # deterministic: a resumed stage rewrites the same rows
            validated(EnvDemosConfig, stage.env_demos),
            first_rl,
            tokenizer=load_tokenizer(resolve_model_path(str(start_model))),
            config_dir=base,
            out=demos_file,
        )
        demo_metrics = demos.summary()
        data["data"] = {**(data.get("data") or {}), "path": str(demos_file)}
    if stage.kind == "sft":
        from rlvr.offline.sft import train_sft

        result = train_sft(validated(SFTConfig, data), resume=True)
    elif stage.kind == "dpo":
        from rlvr.offline.dpo import train_dpo

        result = train_dpo(validated(DPOConfig, data), resume=True)
    elif stage.kind == "reward_model":
        from rlvr.offline.reward_model import train_reward_model

        result = train_reward_model(validated(RewardModelConfig, data), resume=True)
    else:  # distill: teacher samples, then SFT on them
        from rlvr.offline.distill_data import generate_teacher_data
        from rlvr.offline.sft import train_sft

        teacher = _substitute(dict(stage.teacher_data), models)
        prompts = teacher.get("prompts_path")
        if isinstance(prompts, str) and not Path(prompts).is_absolute():
            teacher["prompts_path"] = str((base / prompts).resolve())
        teacher["output_path"] = str(stage_dir / "teacher_samples.jsonl")
        samples = generate_teacher_data(validated(DistillDataConfig, teacher), resume=True)
        sft = {**data, "output_dir": str(stage_dir / "sft")}
        sft["data"] = {**(sft.get("data") or {}), "path": str(samples)}
        result = train_sft(validated(SFTConfig, sft), resume=True)
    return result.model_dir, {**demo_metrics, **result.metrics}, None


def check_stages(cfg: PipelineConfig, base: Path) -> None:
    """Validate every stage's config before anything trains, so a typo in the last stage does not
    surface after an hour of the first; `{stage:NAME}` paths are not checked (they do not exist yet)."""
    from rlvr.offline.config import DistillDataConfig, DPOConfig, RewardModelConfig, SFTConfig

    classes: dict[str, Any] = {
        "sft": SFTConfig,
        "distill": SFTConfig,
        "dpo": DPOConfig,
        "reward_model": RewardModelConfig,
        "rl": RunConfig,
    }
    for stage in cfg.stages:
        data = _without_placeholders(_stage_data(stage, base))
        model = {**(data.get("model") or {}), "name": "placeholder"}
        payload = {**data, "model": model, "output_dir": str(Path(cfg.output_dir) / stage.name)}
        where = f"stage '{stage.name}'"
        try:
            classes[stage.kind].model_validate(payload)
            if stage.kind == "distill":
                teacher = {
                    **_without_placeholders(dict(stage.teacher_data)),
                    "output_path": "x.jsonl",
                }
                DistillDataConfig.model_validate(teacher)
            if stage.env_demos:
                from rlvr.authoring.demos import EnvDemosConfig

                demos = EnvDemosConfig.model_validate(stage.env_demos)
                if demos.config is None and not any(s.kind == "rl" for s in cfg.stages):
                    raise ConfigError(
                        f"{where}: env_demos needs `config:` (an RL config YAML) or an RL stage"
                    )
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err, where)) from None


def _without_placeholders(value: Any) -> Any:
    return _substitute_with(value, lambda _name: "placeholder")


def run_pipeline(
    cfg: PipelineConfig,
    *,
    config_dir: Path | None = None,
    echo: Any = print,
    stop_before: str | None = None,
) -> list[dict[str, Any]]:
    """Run every stage in order; returns one summary row per stage (and one for the start model).
    `stop_before`: run only the stages before this one (a rerun continues from there); the
    efficacy benchmark times a warm-up apart from the RL after it this way.

    Rows: {stage, kind, model_dir, metrics, wall_minutes (training, evals excluded),
    heldout_accuracy (when evaluated)}; also written to
    OUTPUT_DIR/pipeline.json after each stage.
    """
    base = (config_dir or Path.cwd()).resolve()
    check_stages(cfg, base)
    if stop_before is not None and stop_before not in [s.name for s in cfg.stages]:
        raise ConfigError(f"stop_before '{stop_before}' is not a stage of this pipeline")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.yaml").write_text(
        yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
    )
    summary_file = out / "pipeline.json"
    rows: list[dict[str, Any]] = (
        json.loads(summary_file.read_text()) if summary_file.exists() else []
    )
    done_rows = {r["stage"]: r for r in rows}
    eval_cfg = first_rl_config(cfg, base)
    models: dict[str, Path] = {}
    current: Path | str = cfg.model

    def heldout(model: Path | str) -> float | None:
        if eval_cfg is None or not cfg.eval.each_stage:
            return None
        return evaluate_model(str(model), eval_cfg, base, cfg.eval.n)

    if "start" not in done_rows:
        row: dict[str, Any] = {
            "stage": "start",
            "kind": "model",
            "model_dir": str(cfg.model),
            "metrics": {},
        }
        row["heldout_accuracy"] = heldout(cfg.model)
        rows.append(row)
        summary_file.write_text(json.dumps(rows, indent=1))
    for stage in cfg.stages:
        if stage.name == stop_before:
            break
        stage_dir = out / stage.name
        start = models[stage.from_] if stage.from_ is not None else current
        marker = stage_dir / DONE_FILE
        if marker.exists():
            stored = json.loads(marker.read_text())
            model_dir = Path(stored["model_dir"])
            echo(f"[{stage.name}] done earlier: {model_dir}")
        else:
            echo(f"[{stage.name}] {stage.kind} from {start}")
            started = time.time()
            model_dir, metrics, _ = _run_stage(stage, start, stage_dir, base, models, eval_cfg)
            row = {
                "stage": stage.name,
                "kind": stage.kind,
                "model_dir": str(model_dir),
                "metrics": metrics,
                "wall_minutes": (time.time() - started) / 60,  # this run's part (a resume's only)
            }
            if stage.kind != "reward_model":
                row["heldout_accuracy"] = heldout(model_dir)
            rows = [r for r in rows if r["stage"] != stage.name] + [row]
            summary_file.write_text(json.dumps(rows, indent=1))
            marker.write_text(json.dumps({"model_dir": str(model_dir), "metrics": metrics}))
        models[stage.name] = model_dir
        if stage.kind != "reward_model":
            current = model_dir
    return rows


def first_rl_config(cfg: PipelineConfig, base: Path) -> RunConfig | None:
    """The first RL stage's config (its tasks and rewards score every stage), or None."""
    for stage in cfg.stages:
        if stage.kind == "rl":
            data = _stage_data(stage, base)
            if _PLACEHOLDER.search(json.dumps(data)):
                return None  # its rewards need a model that does not exist yet
            try:
                return RunConfig.model_validate(
                    {**data, "output_dir": str(Path(cfg.output_dir) / stage.name)}
                )
            except ValidationError as err:
                raise ConfigError(_format_validation_error(err, f"stage '{stage.name}'")) from None
    return None


def evaluate_model(model: str, cfg: RunConfig, config_dir: Path, n: int) -> float:
    """Greedy held-out accuracy of `model` on `cfg`'s tasks and rubric."""
    from rlvr.build import build_generator, rollout_limits
    from rlvr.evaluate import evaluate_sources
    from rlvr.models import load_policy
    from rlvr.train.sources import Sources, absolutize_reward_files

    cfg = absolutize_reward_files(
        cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": model})}), config_dir
    )
    policy = load_policy(model, device=cfg.model.device)
    sources = Sources(cfg, config_dir)
    generator = build_generator(policy, cfg)
    results = evaluate_sources(
        sources,
        generator,
        policy.tokenizer,
        n=n,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
        stop=tuple(cfg.sampling.stop),
        limits=rollout_limits(cfg),
    )
    return float(results["eval/accuracy"])
