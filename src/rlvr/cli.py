"""`rlvr train | eval | serve | ...`: user errors print one line (`error: ...`) and exit 2, never a traceback.

Longer than our ~500-line guide on purpose: each command here is only its options, help text and a
call into the module that does the work; one file is where a user reads what the CLI offers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    help="Train LLM agents with reinforcement learning from verifiable rewards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(show: bool) -> None:
    if show:
        from rlvr.export import rlvr_version

        typer.echo(f"rlvr {rlvr_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Train LLM agents with reinforcement learning from verifiable rewards."""


def _quiet_libraries() -> None:
    # transformers' and datasets' own progress bars and advisory warnings drown the run's output.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@app.command()
def train(
    config: Annotated[
        Path | None, typer.Argument(help="YAML config (see examples/); optional with --resume.")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override: key.sub=value (repeatable).")
    ] = None,
    output_dir: Annotated[
        str | None, typer.Option("--output-dir", help="RUN_DIR (overrides output_dir).")
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="Continue the run in this RUN_DIR from its last checkpoint, under CONFIG if given, "
            "else under the run's saved config.yaml.",
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Start over in a RUN_DIR that already holds a run: the old run is moved aside to "
            "RUN_DIR.old-<YYYYmmdd-HHMMSS> (nothing is deleted). Without it such a RUN_DIR is "
            "refused.",
        ),
    ] = False,
) -> None:
    """Train a policy as CONFIG says; metrics, rollouts and checkpoints go to the run directory.

    Ctrl-C (or SIGTERM) finishes the current step, saves a checkpoint and exits (130 / 143) with
    the command that resumes; a second Ctrl-C exits at once, without a checkpoint.
    """
    from rlvr.config import load_config
    from rlvr.errors import ConfigError

    overrides = list(set_ or [])
    if resume is not None:
        run_dir = Path(resume)
        if output_dir is not None and Path(output_dir) != run_dir:
            raise ConfigError(
                f"--resume '{resume}' and --output-dir '{output_dir}' disagree; give one"
            )
        saved = run_dir / "config.yaml"
        if not saved.exists():
            raise ConfigError(f"--resume '{resume}': no config.yaml there (not a run directory)")
        source = config if config is not None else saved
        cfg = load_config(source, [*overrides, f"output_dir={run_dir}"])
        config_dir = source.parent
    else:
        if config is None:
            raise ConfigError("give a CONFIG.yaml to train (or --resume RUN_DIR)")
        if output_dir is not None:
            overrides.append(f"output_dir={output_dir}")
        cfg = load_config(config, overrides)
        config_dir = config.parent
    # The config is checked before torch and transformers load (seconds), so a typo answers at once;
    # so is a hub model id that cannot be loaded (transformers would retry for ~30 s).
    from rlvr.hub import check_hub_model, looks_like_hub_id

    if looks_like_hub_id(cfg.model.name):
        check_hub_model(cfg.model.name)
    _quiet_libraries()
    from rlvr.train.loop import train as run_training

    summary = run_training(
        cfg, resume=resume is not None, config_dir=config_dir, overwrite=overwrite
    )
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        _print_summary(
            summary, cfg.tracking.project if "trackio" in cfg.tracking.trackers else None
        )


def _print_summary(summary: object, trackio_project: str | None) -> None:
    from rich.console import Console

    from rlvr.train.loop import RunSummary

    assert isinstance(summary, RunSummary)
    console = Console()
    history = summary.eval_history
    if history:
        first_step, first = history[0]
        last_step, last = history[-1]
        console.print(
            f"[bold]held-out accuracy[/bold]: {first['eval/accuracy']:.1%} (step {first_step}) -> "
            f"{last['eval/accuracy']:.1%} (step {last_step}) on {int(last['eval/n'])} tasks"
        )
        from rich.markup import escape

        from rlvr.evaluate import describe_errors

        # Failed rollouts count as wrong: a low accuracy may be failures, not the model.
        for step, ev in [history[0], history[-1]] if len(history) > 1 else history:
            errored = describe_errors(ev)
            if errored:
                console.print(f"[bold yellow]held-out errors at step {step}[/]: {escape(errored)}")
    console.print(f"steps: {summary.steps_done}   wall time: {summary.wall_seconds / 60:.1f} min")
    console.print(
        f"run directory: {summary.run_dir}  (metrics.jsonl, rollouts.jsonl, checkpoints/)"
    )
    if trackio_project:
        console.print(f"dashboard: trackio show --project {trackio_project}")
    console.print(f"report: rlvr report {summary.run_dir}")
    if summary.stopped_early:
        # A monitor with action `stop` ended the run: say why, and exit non-zero for scripts.
        console.print(f"[bold red]stopped early[/bold red] by a monitor: {summary.stopped_early}")
        raise typer.Exit(3)


@app.command("plan")
def plan_command(
    config: Annotated[Path, typer.Argument(help="YAML config (see examples/).")],
    gpus: Annotated[
        int, typer.Option("--gpus", min=1, help="GPUs the run uses (torchrun --nproc_per_node).")
    ] = 1,
    gpu_memory: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory",
            help="GiB per GPU (plans a GPU run). Default: the CUDA device found here, else the "
            "host's MemAvailable for a CPU run.",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override: key.sub=value (repeatable).")
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option("--prompt-tokens", min=1, help="Longest prompt (default: rendered or 256)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Will it fit? The peak memory per device of CONFIG's run (weights, gradients, optimizer,
    activations, logits, KV cache), before loading any weights, and the smallest change that makes
    it fit. Exit 0 when it fits, 1 when it does not."""
    from rlvr.config import load_config

    cfg = load_config(config, list(set_ or []))
    _quiet_libraries()
    from rlvr.plan import dumps, estimate

    plan = estimate(cfg, gpus=gpus, gpu_memory_gb=gpu_memory, prompt_tokens=prompt_tokens)
    typer.echo(dumps(plan) if as_json else plan.table())
    if plan.fits is False:
        raise typer.Exit(1)


@app.command("eval")
def eval_command(
    model: Annotated[
        str, typer.Argument(help="Model dir, hub id, alias, or a RUN_DIR (its last checkpoint).")
    ],
    task: Annotated[
        str | None,
        typer.Option(
            "--task",
            help="arithmetic, env:NAME (a built-in env), or a config YAML whose tasks to use; "
            "default: the run's own tasks (arithmetic for a bare model).",
        ),
    ] = None,
    n: Annotated[int, typer.Option("--n", help="Held-out tasks to evaluate.")] = 100,
    k: Annotated[
        int, typer.Option("--k", help="Samples per task for mean@k (1 = greedy pass@1 only).")
    ] = 1,
    max_new_tokens: Annotated[
        int | None, typer.Option("--max-new-tokens", help="Default: the run's (or 64 for a model).")
    ] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="For mean@k sampling.")] = 1.0,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override the eval's config: key.sub=value (repeatable), e.g. "
            "task.env.num_heldout=20 or task.env.options.size=3 with --task env:...",
        ),
    ] = None,
) -> None:
    """Greedy pass@1 (and mean@k with --k) on the task's held-out split."""
    _quiet_libraries()
    from rlvr.evaluate_cli import run_eval

    run_eval(
        model,
        task=task,
        n=n,
        k=k,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        overrides=list(set_ or []),
    )


@app.command("inspect")
def inspect_run(
    run_dir: Annotated[Path, typer.Argument(help="RUN_DIR of a training run.")],
    step: Annotated[
        int | None,
        typer.Option("--step", help="Training step to show (default: the latest saved)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="HTML file to write (default: RUN_DIR/inspect/step_NNNNNN.html); with --all, the "
            "folder.",
        ),
    ] = None,
    sort: Annotated[
        str,
        typer.Option(
            "--sort", help="group (by task), reward (highest first) or -reward (lowest first)."
        ),
    ] = "group",
    min_reward: Annotated[
        float | None, typer.Option("--min-reward", help="Show only rewards >= this.")
    ] = None,
    max_reward: Annotated[
        float | None, typer.Option("--max-reward", help="Show only rewards <= this.")
    ] = None,
    all_steps: Annotated[
        bool, typer.Option("--all", help="Write every saved step's page (prev/next links).")
    ] = False,
) -> None:
    """Write a static HTML page of one step's trajectories, tokens coloured by mask and advantage;
    pages link to the previous / next saved steps."""
    from rlvr.errors import ConfigError
    from rlvr.observe.inspect import render_all, render_html

    if sort not in ("group", "reward", "-reward"):
        raise ConfigError(f"--sort '{sort}': expected group, reward or -reward")
    bounds: dict[str, Any] = {"sort": sort, "min_reward": min_reward, "max_reward": max_reward}
    if all_steps:
        if step is not None:
            raise ConfigError("give --step or --all, not both")
        for page in render_all(run_dir, out, **bounds):
            print(page)
        return
    print(render_html(run_dir, step=step, out=out, **bounds))


@app.command("check-reward")
def check_reward_command(
    function: Annotated[
        str, typer.Argument(help="A built-in reward name, MODULE:FUNCTION or FILE.py:FUNCTION.")
    ],
    task: Annotated[
        str, typer.Option("--task", help="arithmetic, or a config YAML whose tasks to use.")
    ] = "arithmetic",
    n: Annotated[int, typer.Option("--n", help="Held-out tasks to try each hack on.")] = 20,
    style: Annotated[
        str,
        typer.Option(
            "--style",
            help="How to call the function, as a rubric's `style:`: auto (TRL's batch signature "
            "when it has a `completions` parameter, else rlvr's), rlvr (fn(completion, "
            "**task_fields)), trl (lists, completions as chat messages) or trl_text (lists of "
            "strings).",
        ),
    ] = "auto",
) -> None:
    """Run known reward hacks against a reward function; exit 1 if it pays for any."""
    from rlvr.config import load_config
    from rlvr.errors import ConfigError
    from rlvr.tasks import load_tasks
    from rlvr.verifiers import RewardFunction, resolve_reward_fn
    from rlvr.verifiers.redteam import red_team
    from rlvr.verifiers.trl_style import RewardStyle, detect_style

    cfg = load_config(task if task.endswith((".yaml", ".yml")) else None)
    if not task.endswith((".yaml", ".yml")) and task != "arithmetic":
        raise ConfigError(f"--task '{task}': expected arithmetic or a config .yaml")
    styles: dict[str, RewardStyle] = {"rlvr": "rlvr", "trl": "trl", "trl_text": "trl_text"}
    if style != "auto" and style not in styles:
        raise ConfigError(f"--style '{style}': expected auto, rlvr, trl or trl_text")
    tasks = load_tasks(cfg.task).heldout[:n]
    fn = resolve_reward_fn(function, base_dir=Path.cwd())
    # As a rubric calls it (rlvr.build.build_rubric): a TRL batch function gets lists, one entry
    # per completion, not a completion string it would fail on and be called broken for.
    called = detect_style(fn) if style == "auto" else styles[style]
    reward = RewardFunction(name=function, fn=fn, style=called)
    if called != "rlvr":
        print(f"calling {function} TRL's way (style {called}: lists, one entry per completion)")
    report = red_team(reward, tasks)
    if report.reference_tried:
        print(f"reference answer paid on {report.reference_paid}/{report.reference_tried} tasks")
    for hack in report.hacks:
        verdict = f"PAID on {hack.paid}/{hack.tried}  e.g. {hack.example!r}" if hack.paid else "ok"
        print(f"  {hack.hack:<36} {verdict}")
    if report.broken:
        print(
            f"the function raised on {report.errors} of {report.calls} calls and paid for nothing "
            f"({report.first_error}): it is broken"
        )
    elif report.errors:
        print(
            f"  ({report.errors} of {report.calls} calls raised, counted as not paid; first: "
            f"{report.first_error})"
        )
    if report.reference_tried and report.reference_paid == 0:
        print("the function never paid for the reference answer: it cannot be judged safe")
    if not report.ok:
        raise typer.Exit(1)
    print("no known hack is paid")


@app.command("envs")
def envs_command() -> None:
    """List the built-in environments, one line each, with their example config."""
    from rlvr.envs import ENV_FAMILIES
    from rlvr.envs.base import get_env_family

    get_env_family("calculator")  # imports and registers the built-ins
    width = max(len(name) for name in ENV_FAMILIES)
    for name in sorted(ENV_FAMILIES):
        family = ENV_FAMILIES[name]
        example = f"  ({family.example_config})" if family.example_config else ""
        print(f"{name:<{width}}  {family.description}{example}")


env_app = typer.Typer(help="Work with environments.", no_args_is_help=True)
app.add_typer(env_app, name="env")


@env_app.command("check")
def env_check_command(
    name: Annotated[
        str, typer.Argument(help="A built-in env name, or FILE.py:Family / module:Family.")
    ],
    model: Annotated[
        str | None,
        typer.Option("--model", help="Sample the turns from this model (dir, alias or hub id)."),
    ] = None,
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer", help="Tokenizer and chat template to render with (no --model)."
        ),
    ] = "smollm2-135m-instruct",
    episodes: Annotated[int, typer.Option("--episodes", help="Episodes to play.")] = 2,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Env option: option=value (repeatable).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="First instance seed.")] = 0,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Token cap per assistant turn.")
    ] = 256,
    max_turns: Annotated[
        int | None, typer.Option("--max-turns", help="Turn cap (default: the env's).")
    ] = None,
    color: Annotated[
        bool, typer.Option("--color", help="Trained tokens in green instead of [[...]].")
    ] = False,
    tool_format: Annotated[
        str,
        typer.Option(
            "--tool-format",
            help="Tool-call format: auto (the chat template's), hermes, qwen3, llama3_json, mistral.",
        ),
    ] = "auto",
    history: Annotated[
        str,
        typer.Option(
            "--history",
            help="full, or window: each turn sampled from the opening + the last K turns "
            "(rollout.history); the windowed prompts are shown.",
        ),
    ] = "full",
    history_turns: Annotated[
        int, typer.Option("--history-turns", help="K for --history window.", min=1)
    ] = 2,
) -> None:
    """Play a few episodes (scripted, random or --model policy) and print, per turn, the rendered
    chat template, the tool schemas and tool-call format as the model sees them, trained vs masked
    tokens and the reward parts (with --history window, each turn's windowed prompt). Exits 1 when
    a mask or template invariant is broken."""
    import yaml

    from rlvr.errors import ConfigError

    options: dict[str, Any] = {}
    for item in set_ or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set '{item}': expected option=value")
        options[key.strip()] = yaml.safe_load(value)
    _quiet_libraries()
    from rlvr.authoring.check import check_env
    from rlvr.envs.tool_formats import TOOL_FORMATS
    from rlvr.models import eos_token_ids, load_policy, load_tokenizer, resolve_model_path

    if history not in ("full", "window"):
        raise ConfigError(f"--history '{history}': expected full or window")
    if tool_format != "auto" and tool_format not in TOOL_FORMATS:
        known = ", ".join(["auto", *TOOL_FORMATS])
        raise ConfigError(f"--tool-format '{tool_format}': expected one of {known}")

    generator = None
    if model is not None:
        from rlvr.rollout.hf import HFGenerator

        policy = load_policy(model)
        tok = policy.tokenizer
        eos = eos_token_ids(policy.model, tok)
        generator = HFGenerator(policy.model, tok, eos, seed=seed, autocast_bf16=False)
    elif (Path(tokenizer) / "tokenizer_config.json").is_file():  # a tokenizer folder, no model
        tok = load_tokenizer(tokenizer)
    else:
        tok = load_tokenizer(resolve_model_path(tokenizer))
    problems = check_env(
        name,
        tokenizer=tok,
        options=options,
        episodes=episodes,
        seed=seed,
        generator=generator,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
        tool_format=tool_format,
        colour=color,
        history="window" if history == "window" else "full",
        history_turns=history_turns,
    )
    if problems:
        raise typer.Exit(1)


@env_app.command("demos")
def env_demos_command(
    target: Annotated[
        str,
        typer.Argument(
            help="A built-in env name, FILE.py:Family, or an RL config YAML (its env, train split "
            "and rollout limits)."
        ),
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="The JSONL file to write.")],
    episodes: Annotated[int, typer.Option("--episodes", help="Demonstrations to play.")] = 160,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="random: random legal actions (teaches the format, not the task); scripted: the "
            "env's solver (behaviour cloning: teaches the task).",
        ),
    ] = "random",
    seed: Annotated[
        int, typer.Option("--seed", help="Which instances, and the random choices.")
    ] = 0,
    max_turns: Annotated[
        int | None, typer.Option("--max-turns", help="Turn cap (default: the config's / env's).")
    ] = None,
    noise: Annotated[
        float,
        typer.Option(
            "--noise",
            help="With --policy scripted: chance a turn is a random legal action instead, kept "
            "as untrained context (DART's noise injection).",
        ),
    ] = 0.0,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Config override, e.g. task.env.options.size=5 (repeatable)."),
    ] = None,
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer", help="The chat template the rows must match (the SFT model's)."
        ),
    ] = "smollm2-135m-instruct",
) -> None:
    """Play episodes of an env's TRAIN split (never a held-out instance) through the rollout engine
    and write them as SFT chat rows {"messages": [...]}, exactly the conversation RL shows: a format
    warm-up before RL (rlvr.authoring.demos)."""
    from rlvr.errors import ConfigError

    if policy not in ("random", "scripted"):
        raise ConfigError(f"--policy '{policy}': expected random or scripted")
    if episodes < 1:
        raise ConfigError(f"--episodes {episodes}: expected at least 1")
    if not 0.0 <= noise < 1.0:
        raise ConfigError(f"--noise {noise:g}: expected a chance in [0, 1)")
    _quiet_libraries()
    from rlvr.authoring.demos import demo_config, play_demos, write_rows

    cfg, config_dir = demo_config(target, list(set_ or []))
    demos = play_demos(
        cfg,
        tokenizer=tokenizer,  # loaded after the env builds: a bad env name fails at once
        episodes=episodes,
        policy="scripted" if policy == "scripted" else "random",
        seed=seed,
        max_turns=max_turns,
        config_dir=config_dir,
        noise=noise,
    )
    if not demos.rows:
        raise ConfigError(
            "every demonstration was dropped (a first turn cut by a token limit, or all noise)"
        )
    write_rows(demos.rows, output)
    teaches = "the format only, not the task" if policy == "random" else "the task (a solver)"
    print(
        f"wrote {len(demos.episodes)} demonstrations of env {demos.env} to {output} (policy {policy}: "
        f"teaches {teaches}), drawn from {demos.train_instances} train instances; "
        + (
            f"{len(demos.rows)} rows, one per turn (rollout.history window); "
            if demos.per_turn
            else ""
        )
        + f"success {demos.success_rate:.1%}, {demos.mean_turns:.1f} turns each; "
        f"{demos.trimmed} ended before a turn cut by the token budget, "
        f"{demos.dropped_cut + demos.dropped_error + demos.dropped_untrained} dropped"
        + (f"; noise {noise:g}: random turns kept as untrained context" if noise else "")
    )


runs_app = typer.Typer(help="Work with several run directories.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")


@app.command("export")
def export_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    out: Annotated[Path, typer.Argument(help="New folder for the model (must not hold files).")],
    step: Annotated[
        int | None, typer.Option("--step", help="Checkpoint step (default: the last).")
    ] = None,
    merge_lora: Annotated[
        bool,
        typer.Option(
            "--merge-lora",
            help="LoRA run: fold the adapters into the base weights (default: a PEFT adapter).",
        ),
    ] = False,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="float32, bfloat16 or float16 (fp32, bf16, fp16; default: as trained; bf16 halves the size but "
            "rounds away updates smaller than its precision).",
        ),
    ] = None,
) -> None:
    """Write a run's policy as a Hugging Face model folder (safetensors, tokenizer, chat template,
    generation config) with a model card, loadable by transformers and `vllm serve`."""
    _quiet_libraries()
    from rlvr.export import export_run

    exported = export_run(run_dir, out, step=step, merge_lora=merge_lora, dtype=dtype)
    typer.echo(f"export: {exported.resolve()}")


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder (default RUN_DIR/report/).")
    ] = None,
) -> None:
    """A static HTML report of a run: curves with alert markers, best/worst rollouts, config."""
    from rlvr.observe.report import write_report

    typer.echo(f"report: {write_report(run_dir, out).resolve()}")


@runs_app.command("compare")
def runs_compare_command(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories.")],
    out: Annotated[Path, typer.Option("--out", help="Output folder.")] = Path("compare"),
) -> None:
    """Key curves of several runs on shared plots, and a summary table."""
    from rich.console import Console

    from rlvr.observe.compare import compare_runs, summary_rows, summary_table

    Console().print(summary_table(summary_rows(run_dirs)))
    typer.echo(f"compare: {compare_runs(run_dirs, out).resolve()}")


@app.command("review")
def review_cli(
    model: Annotated[str, typer.Argument(help="Model alias, directory, hub id, or a RUN_DIR.")],
    baseline: Annotated[
        str, typer.Option("--baseline", help="What to compare against (e.g. the base model).")
    ],
    task: Annotated[
        str | None,
        typer.Option("--task", help="arithmetic, env:NAME or CONFIG.yaml; default the run's own."),
    ] = None,
    n: Annotated[
        int, typer.Option("--n", help="Held-out tasks scored (and prompts for the KL).")
    ] = 50,
    probes: Annotated[
        Path | None, typer.Option("--probes", help="Sycophancy probes JSONL (default built-in).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder for review.json / review.md.")
    ] = None,
) -> None:
    """Launch review: verifier correctness, sycophancy rate, KL from the baseline, mean length."""
    _quiet_libraries()
    from rlvr.review import review_command

    review_command(model, baseline, task, n, probes, out)


@app.command("pipeline")
def pipeline_command(
    config: Annotated[Path, typer.Argument(help="Pipeline YAML: model, output_dir, stages.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override: key.sub=value (repeatable).")
    ] = None,
    output_dir: Annotated[
        str | None, typer.Option("--output-dir", help="Run directory (overrides output_dir).")
    ] = None,
) -> None:
    """Run stages in order (sft, distill, dpo, reward_model, rl), each from the previous model.

    Rerunning the same command resumes: finished stages are skipped, an interrupted one continues.
    """
    from rlvr.pipeline import load_pipeline_config, run_pipeline

    overrides = list(set_ or [])
    if output_dir is not None:
        overrides.append(f"output_dir={output_dir}")
    cfg = load_pipeline_config(config, overrides)
    _quiet_libraries()
    from rlvr.errors import RunInterrupted

    try:
        rows = run_pipeline(cfg, config_dir=config.parent)
    except RunInterrupted as err:
        # A pipeline resumes by running the same command again, not with `rlvr train --resume`.
        again = " ".join(["rlvr pipeline", str(config), *(f"--set {o}" for o in overrides)])
        raise RunInterrupted(err.step, err.run_dir, err.signum, hint=again) from None
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pipeline {cfg.output_dir}")
    for column in ("stage", "kind", "held-out accuracy", "final metrics"):
        table.add_column(column)
    for row in rows:
        acc = row.get("heldout_accuracy")
        shown = {k: v for k, v in row["metrics"].items() if not k.startswith("eval/source")}
        table.add_row(
            row["stage"],
            row["kind"],
            "" if acc is None else f"{acc:.1%}",
            ", ".join(f"{k}={v:.3g}" for k, v in list(shown.items())[:4]),
        )
    Console().print(table)


def _offline_stage(kind: str, config: Path, overrides: list[str]) -> None:
    from rlvr.offline.config import DPOConfig, RewardModelConfig, SFTConfig, load_stage_config

    classes: dict[str, Any] = {
        "sft": SFTConfig,
        "dpo": DPOConfig,
        "reward-model": RewardModelConfig,
    }
    cfg = load_stage_config(classes[kind], config, overrides)
    _quiet_libraries()
    from rlvr.offline import train_dpo, train_reward_model, train_sft

    runners: dict[str, Any] = {
        "sft": train_sft,
        "dpo": train_dpo,
        "reward-model": train_reward_model,
    }
    run = runners[kind]
    from rlvr.errors import RunInterrupted

    try:
        result = run(cfg, resume=True)
    except RunInterrupted as err:  # the same command continues an offline stage
        again = " ".join([f"rlvr {kind}", str(config), *(f"--set {o}" for o in overrides)])
        raise RunInterrupted(err.step, err.run_dir, err.signum, hint=again) from None
    print(f"model: {result.model_dir}")
    print(" ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()))


_SET_HELP = "Override: key.sub=value (repeatable)."


@app.command("sft")
def sft_command(
    config: Annotated[Path, typer.Argument(help="SFT stage YAML (rlvr.offline.config.SFTConfig).")],
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
) -> None:
    """Supervised fine-tuning on chat data, loss on assistant tokens only; resumes if interrupted."""
    _offline_stage("sft", config, list(set_ or []))


@app.command("dpo")
def dpo_command(
    config: Annotated[Path, typer.Argument(help="DPO stage YAML (rlvr.offline.config.DPOConfig).")],
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
) -> None:
    """Direct preference optimisation (sigmoid, ipo, hinge) on chosen/rejected pairs."""
    _offline_stage("dpo", config, list(set_ or []))


@app.command("reward-model")
def reward_model_command(
    config: Annotated[
        Path, typer.Argument(help="Reward-model YAML (rlvr.offline.config.RewardModelConfig).")
    ],
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
) -> None:
    """Train a Bradley-Terry reward model on chosen/rejected pairs."""
    _offline_stage("reward-model", config, list(set_ or []))


@app.command("serve")
def serve_command(
    model: Annotated[
        str, typer.Argument(help="Model dir, hub id, alias, or a RUN_DIR (its last checkpoint).")
    ],
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
    model_name: Annotated[
        str | None,
        typer.Option("--model-name", help="The id clients pass as `model` (default: MODEL)."),
    ] = None,
    record_dir: Annotated[
        Path | None,
        typer.Option(
            "--record-dir", help="Also write each recorded rollout to DIR/<rollout id>.json."
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Sampler seed.")] = 0,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="RLVR_API_KEY",
            help="Require `Authorization: Bearer KEY` on every endpoint; without it adapter loads "
            "and weight reloads are refused. Prefer the environment variable (argv is visible).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve MODEL behind an OpenAI-compatible API (/v1/chat/completions with tools and log-probs,
    /v1/completions on token ids); exchanges under a rollout id are recorded token-exactly."""
    _quiet_libraries()
    import uvicorn

    from rlvr.errors import ConfigError
    from rlvr.evaluate_cli import load_model
    from rlvr.serve.app import create_app
    from rlvr.serve.runner import serve_state

    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key / RLVR_API_KEY is empty: give a key or unset it")
    policy, _ = load_model(model)
    state = serve_state(policy, model_name or model, seed=seed)
    app_ = create_app(state, record_dir=record_dir, api_key=api_key)
    print(f"rlvr serve: {model} as '{state.model_name}' on http://{host}:{port}/v1", flush=True)
    if api_key is None:
        print(
            "no API key: open to anyone who reaches the port; adapter loads and weight reloads are "
            "refused (--api-key or RLVR_API_KEY)",
            flush=True,
        )
    uvicorn.run(app_, host=host, port=port, log_level="warning")


# `rlvr sandbox check` and `rlvr sandbox serve` live with the sandbox (rlvr/sandbox/cli.py).
from rlvr.sandbox.cli import sandbox_app  # noqa: E402

app.add_typer(sandbox_app, name="sandbox")


def main() -> None:
    from rlvr.errors import RlvrError, RunInterrupted

    try:
        app()
    except RunInterrupted as err:
        import signal

        # The checkpoint is written: a Ctrl-C pressed again now must not turn exit 130 into a
        # death by SIGINT (-2) halfway through this message.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(err, file=sys.stderr)
        sys.exit(err.exit_code)
    except RlvrError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: metrics and checkpoints written so far are kept", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
