"""Demonstrations played in an env, written as SFT chat rows: a format warm-up before RL.

    rlvr env demos frozenlake --episodes 160 --policy random -o demos.jsonl
    rlvr env demos examples/env_frozenlake.yaml --episodes 160 -o demos.jsonl   # that run's env
    (in a pipeline: an `sft` stage with `env_demos: {episodes: 160}`, see rlvr.pipeline)

Why: SmolLM2-135M almost never writes a well-formed action unprompted (well-formed first turns on
train instances: frozenlake 2/32, sokoban 0/32, sudoku 0/32, countdown 2/32), so RL alone spends its
first tens of steps discovering the `<answer>` tag before it can learn the task
(docs/efficacy_notes.md). A short SFT on demonstrations teaches the tag first.

What the demonstrations teach depends on the policy:
- `random` (the warm-up): every turn is a random LEGAL, well-formed action from the family's
  `random_action(task, messages, rng) -> str` (a move chosen uniformly, a Sudoku grid of random
  digits, a Countdown expression with random operators...). The choice is blind, so SFT on them
  teaches the answer FORMAT and the turn protocol, not the task: a random walk rarely reaches the
  goal, and the policy it clones has no preference among legal actions. Episodes end where the env
  ends them or at the turn cap (the RL config's, or `max_turns` to keep the rows short).
- `scripted`: the family's solver, `scripted_action(task, messages) -> str`. This is behaviour
  cloning: it teaches the task itself, and a table that uses it must say so.
- `scripted` with `noise: p` (DART's noise injection; Laskey et al. 2017, "DART: Noise Injection for
  Robust Imitation Learning"): each turn, with probability p, the family's random legal action is
  played instead. Those turns stay in the row as context marked `"training": false`; the solver's
  turns after them are trained, so the clone sees how the solver recovers from states off its own
  path (a plain clone has only seen the solver's path, and errs where its own mistakes lead it:
  the frozenlake clone, sampled, kept walking into the lake's edge). A row whose every kept turn
  was noise is dropped and counted.
(`messages` is the episode's conversation after the opening: assistant turns and observations.
Both write tool calls in Hermes; they are rewritten in the format the engine reads for the
tokenizer, `rollout.tool_format`, as `rlvr env check` does: envs/tool_formats.py `from_hermes`.)

Faithful to RL, so SFT sees the template RL will:
- the instances are the RL config's TRAIN split, built by the same `Sources` training builds (env,
  options, num_train, heldout_fraction), so a held-out instance is never demonstrated;
- the episodes are played through the real rollout engine (rollout/engine.py) with the config's
  limits (turn cap, token budget, observation truncation), the policy's text tokenized and ended
  with EOS as a sampled turn would be (check.py's `_PolicyGenerator`);
- a row's `messages` are exactly the conversation the engine showed: the opening as rendered
  (tool schemas written into the system message where the template ignores `tools=`), each
  assistant turn as decoded, each observation as truncated. SFT renders them with the same chat
  template, so its tokens are the trajectory's tokens, plus the template's newline after each
  end-of-turn token, which RL treats as glue and SFT trains on (tests/test_env_demos.py).
A turn cut by the episode's token budget ends its row before that turn (an SFT row would teach a
turn ended where the engine never lets one end); an episode whose first turn was cut, or whose env
failed, is dropped. Both are counted.

With `rollout.history: window` (K = `rollout.history_turns`) RL samples, and trains, each turn from
the opening plus the last K turns only (rlvr.rollout.engine), so the demonstrations are written the
same way: one row per trained turn, its messages the opening, the K turns before it as context and
the turn itself, the only one trained (`train_from`). A row renders to that turn's sample
(`Trajectory.turn_samples`) token for token. The opening is repeated in every row, so the SFT
trains more tokens per demonstrated turn than with whole conversations.

Rows: {"messages": [...], "train_from", "task_id", "policy", "success", "turns"} (and "turn", the
turn a window row trains, from 1); `success` and `turns` are the episode's. The SFT loader
reads `messages` (role and content) and `train_from` (the opening's length: an assistant message in
the opening, such as the calculator's worked example, is context in RL and stays untrained in SFT)
and ignores the rest.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rlvr.authoring.check import Policy, _PolicyGenerator, _Recorder
from rlvr.config import RunConfig, _Section, load_config
from rlvr.envs.base import Env, EnvFamily, EnvReset
from rlvr.envs.tool_formats import ToolFormat, from_hermes, resolve_tool_format
from rlvr.errors import ConfigError
from rlvr.records import Task, Trajectory
from rlvr.rollout.chat import template_renders_tools, with_tool_instructions
from rlvr.rollout.generator import SamplingParams

DemoPolicy = Literal["random", "scripted"]


class EnvDemosConfig(_Section):
    """Demonstrations for an SFT stage (a pipeline's `env_demos:`), or `rlvr env demos`' options."""

    config: str | None = Field(
        None,
        description="An RL config YAML whose env, train split and rollout limits to play "
        "(relative to the pipeline config); default: the pipeline's first RL stage.",
    )
    episodes: int = Field(
        160, ge=1, description="Demonstrations (train instances, reused past all)."
    )
    policy: DemoPolicy = Field(
        "random",
        description="random: random legal actions (teaches the format only); scripted: the "
        "family's solver (behaviour cloning: teaches the task).",
    )
    noise: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="With policy scripted: the chance that a turn plays a random legal action "
        "instead (kept as untrained context; DART's noise injection).",
    )
    seed: int = Field(0, description="Which train instances, and the random policy's choices.")
    max_turns: int | None = Field(
        None, ge=1, description="Turn cap of a demonstration (default: the RL config's / env's)."
    )


@dataclass(frozen=True)
class Demos:
    """What was played: the rows kept, and why the others were not."""

    rows: list[dict[str, Any]]
    env: str
    policy: DemoPolicy
    train_instances: int  # size of the train split the episodes were drawn from
    dropped_cut: int  # the first turn was cut by a token limit
    dropped_error: int  # the env failed
    dropped_untrained: int  # with noise: every kept turn was a random one, so nothing to train
    trimmed: int  # kept up to the turn before one cut by the token budget
    # the engine's record of each row, in order: its episode, or with a history window the
    # turn's own sample (Trajectory.turn_samples)
    trajectories: list[Trajectory]
    episodes: list[dict[str, float]]  # per kept episode: success, turns, noise_turns
    per_turn: bool = False  # rollout.history window: a row per trained turn, not per episode

    @property
    def success_rate(self) -> float:
        return sum(e["success"] for e in self.episodes) / max(1, len(self.episodes))

    @property
    def mean_turns(self) -> float:
        return sum(e["turns"] for e in self.episodes) / max(1, len(self.episodes))

    def summary(self) -> dict[str, float]:
        """Numbers for a stage's metrics: how many rows, and how often the demonstrator won."""
        return {
            "demos/rows": float(len(self.rows)),
            "demos/success_rate": self.success_rate,
            "demos/mean_turns": self.mean_turns,
            "demos/dropped": float(self.dropped_cut + self.dropped_error + self.dropped_untrained),
            "demos/trimmed": float(self.trimmed),
            "demos/episodes": float(len(self.episodes)),
            # random turns per episode with noise (untrained context); 0 without
            "demos/noise_turns": sum(e["noise_turns"] for e in self.episodes)
            / max(1, len(self.episodes)),
        }


class _OpeningRecorder(_Recorder):
    """check.py's recorder (the conversation for the policy, the engine's limits forwarded), which
    also keeps the opening the env gave, for the row's first messages."""

    opening: EnvReset

    def reset(self) -> EnvReset:
        self.opening = super().reset()
        return self.opening


def demo_config(target: str, overrides: list[str] | None = None) -> tuple[RunConfig, Path]:
    """(RunConfig, its folder) for `rlvr env demos TARGET`: an RL config YAML as it is, or an env
    name / FILE.py:Family with the config defaults; `overrides` are `--set` paths of a RunConfig
    (task.env.options.size=5, rollout.max_turns=4, task.env.num_train=500)."""
    if target.endswith((".yaml", ".yml")):
        return load_config(target, overrides), Path(target).resolve().parent
    # A FILE.py:Family is read from the working directory, as `rlvr env check` reads it.
    names = ["task.source=env", f"task.env.name={target}", *(overrides or [])]
    return load_config(None, names), Path.cwd()


def _policy(
    family: EnvFamily,
    kind: DemoPolicy,
    seed: int,
    episode: int,
    calls: ToolFormat,
    noise: float = 0.0,
    noisy_turns: list[bool] | None = None,
) -> Policy:
    """The episode's policy; its Hermes `<tool_call>` blocks are rewritten in `calls`, the format
    the engine reads for this tokenizer (as `rlvr env check` shows a scripted solver). With
    `noise`, each turn's choice (True: the random action) is appended to `noisy_turns`."""
    rng = random.Random(f"{seed}:{episode}")
    if kind == "scripted":
        scripted = getattr(family, "scripted_action", None)
        if not callable(scripted):
            raise ConfigError(
                f"env '{family.name}' has no scripted_action(task, messages) to clone; "
                "use policy random"
            )
        if not noise:
            return lambda task, messages: from_hermes(scripted(task, messages), calls)
        act = _random_action(family, "or set noise: 0")
        record = noisy_turns if noisy_turns is not None else []

        def noisy(task: Task, messages: list[dict[str, Any]]) -> str:
            record.append(rng.random() < noise)
            text = act(task, messages, rng) if record[-1] else scripted(task, messages)
            return from_hermes(text, calls)

        return noisy
    act = _random_action(family, "or use policy scripted")
    return lambda task, messages: from_hermes(act(task, messages, rng), calls)


def _random_action(family: EnvFamily, otherwise: str) -> Any:
    act = getattr(family, "random_action", None)
    if not callable(act):
        raise ConfigError(
            f"env '{family.name}' has no random_action(task, messages, rng): define one that "
            f"returns a random legal, well-formed action, {otherwise}"
        )
    return act


def play_demos(
    cfg: RunConfig,
    *,
    tokenizer: Any,
    episodes: int,
    policy: DemoPolicy = "random",
    seed: int = 0,
    max_turns: int | None = None,
    config_dir: Path | None = None,
    noise: float = 0.0,
) -> Demos:
    """Play `episodes` demonstrations on `cfg`'s train split (see the module docstring).

    `tokenizer`: a tokenizer, or a model name / path whose tokenizer is loaded only once the env is
    known to build (a first use of the bundled model converts it: ~20 s before a one-line error)."""
    from rlvr.build import rollout_limits
    from rlvr.rollout.engine import rollout_groups
    from rlvr.train.sources import Sources

    if cfg.mixture or cfg.task.source != "env":
        raise ConfigError("env demos need a config with one env (task.source: env, no mixture)")
    if noise and policy != "scripted":
        raise ConfigError(
            f"env demos: noise {noise:g} is for policy scripted (random turns injected into "
            "the solver's episodes); policy random is all noise already"
        )
    (source,) = list(Sources(cfg, config_dir))
    family = source.family
    assert family is not None
    train = source.splits.train
    if isinstance(tokenizer, str):
        from rlvr.models import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(tokenizer))
    order = list(range(len(train)))
    random.Random(f"demos:{seed}").shuffle(order)
    limits = replace(rollout_limits(cfg), env_workers=1)
    if max_turns is not None:
        limits = replace(limits, max_turns=max_turns)
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=cfg.sampling.max_new_tokens)
    calls = resolve_tool_format(limits.tool_format, tokenizer)
    eos = tokenizer.eos_token_id
    rows: list[dict[str, Any]] = []
    kept: list[Trajectory] = []
    episode_stats: list[dict[str, float]] = []
    dropped_cut = dropped_error = dropped_untrained = trimmed = 0
    for episode in range(episodes):
        task = train[order[episode % len(order)]]
        noisy_turns: list[bool] = []  # per turn: played by the random policy (noise > 0)
        act = _policy(family, policy, seed, episode, calls, noise, noisy_turns)
        recorder = _OpeningRecorder(family.make(task))
        generator = _PolicyGenerator(act, tokenizer, task, recorder)

        def make_env(_task: Task, recorder: _OpeningRecorder = recorder) -> Env:
            return recorder

        group = rollout_groups(
            [task], make_env, generator, tokenizer, sampling, source.scoring, limits
        )
        traj = group[0].trajectories[0]
        if traj.finish_reason == "error" or traj.reward_errors:
            dropped_error += 1
            continue
        # Turns that ended with EOS, from the first; a turn cut by the token budget ends the row
        # before it (with the observation that led to it): the engine never lets a turn end so.
        complete = next(
            (k for k, span in enumerate(traj.turns) if traj.token_ids[span.end - 1] != eos),
            len(traj.turns),
        )
        if complete == 0:
            dropped_cut += 1
            continue
        if noisy_turns and all(noisy_turns[:complete]):
            dropped_untrained += 1
            continue
        trimmed += complete < len(traj.turns)
        assistant_at = [i for i, m in enumerate(traj.messages) if m.get("role") == "assistant"]
        after_opening = [dict(m) for m in traj.messages[: assistant_at[complete - 1] + 1]]
        for turn, noisy in enumerate(noisy_turns[:complete]):
            if noisy:  # context, not trained: the solver's next turn is what SFT learns
                after_opening[assistant_at[turn]]["training"] = False
        opening = recorder.opening
        if opening.tools and template_renders_tools(tokenizer):
            raise ConfigError(
                f"env '{family.name}' has tools and this chat template renders tools= itself; "
                "SFT rows carry no tools=, so demonstrations would not match what RL shows"
            )
        messages = with_tool_instructions(tokenizer, opening.messages, opening.tools, calls)
        noise_turns = sum(noisy_turns[:complete])
        stats = {
            "success": float(traj.rewards.get(source.metric, 0.0) >= 1.0),
            "turns": complete,
        }
        episode_stats.append({**stats, "noise_turns": noise_turns})
        about = {"task_id": task.id, "policy": policy, **stats}
        if noise:
            about["noise_turns"] = noise_turns
        if limits.history == "full":
            # an opening's worked example is context, as in RL: train_from
            rows.append({"messages": [*messages, *after_opening], "train_from": len(messages)})
            rows[-1].update(about)
            kept.append(traj)
            continue
        samples = traj.turn_samples()
        for k in range(complete):
            if k < len(noisy_turns) and noisy_turns[k]:
                continue  # a random turn: context of the later windows only
            first = assistant_at[max(0, k - limits.history_turns)]
            window = [*messages, *after_opening[first : assistant_at[k] + 1]]
            rows.append({"messages": window, "train_from": len(window) - 1, "turn": k + 1})
            rows[-1].update(about)
            kept.append(samples[k])
    return Demos(
        rows, family.name, policy, len(train), dropped_cut, dropped_error, dropped_untrained,
        trimmed, kept, episode_stats, limits.history == "window",
    )  # fmt: skip


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """JSONL, one row a line, written whole or not at all (a stage resumed after a crash must not
    train on half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(partial, path)


def demos_for_stage(
    settings: EnvDemosConfig,
    rl_config: RunConfig | None,
    *,
    tokenizer: Any,
    config_dir: Path,
    out: Path,
) -> Demos:
    """A pipeline stage's demonstrations, written to `out`: from `settings.config` (relative to
    `config_dir`) or else `rl_config` (the pipeline's first RL stage)."""
    if settings.config is not None:
        path = Path(settings.config)
        path = path if path.is_absolute() else config_dir / path
        cfg, cfg_dir = load_config(path), path.parent
    elif rl_config is not None:
        cfg, cfg_dir = rl_config, config_dir
    else:
        raise ConfigError("env_demos needs `config:` (an RL config YAML) or a later RL stage")
    demos = play_demos(
        cfg,
        tokenizer=tokenizer,
        episodes=settings.episodes,
        policy=settings.policy,
        seed=settings.seed,
        max_turns=settings.max_turns,
        config_dir=cfg_dir,
        noise=settings.noise,
    )
    if not demos.rows:
        raise ConfigError(
            f"env '{demos.env}': every demonstration was dropped ({demos.dropped_cut} cut by a "
            f"token limit, {demos.dropped_error} env errors, {demos.dropped_untrained} all "
            "noise); raise sampling.max_new_tokens or lower noise"
        )
    write_rows(demos.rows, out)
    return demos
