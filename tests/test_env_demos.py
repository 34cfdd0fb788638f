"""`rlvr env demos` (rlvr.authoring.demos): demonstrations for a format warm-up before RL.

What must hold: a random demonstration's every assistant turn is a legal, well-formed action of
its env (replayed in a fresh env, no turn is invalid); only train instances are played; the rows
load in the SFT data loader, and their tokens and trained positions are the engine's for the same
episode; the scripted policy solves; errors are one line."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rlvr.authoring.demos import demo_config, play_demos, write_rows
from rlvr.cli import app
from rlvr.config import TaskConfig
from rlvr.envs.base import EnvStep, get_env_family, stable_fraction
from rlvr.errors import ConfigError
from rlvr.models import tiny_tokenizer
from rlvr.offline.data import load_rows, sft_examples
from rlvr.records import Task
from rlvr.tasks import load_tasks

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Char-level tokenizer: every turn needs as many tokens as it has characters.
ROOMY = ["sampling.max_new_tokens=160", "rollout.max_total_tokens=1200"]


def demos_of(name: str, policy: str = "random", episodes: int = 12, *sets: str) -> Any:
    cfg, config_dir = demo_config(str(EXAMPLES / f"env_{name}.yaml"), [*ROOMY, *sets])
    demos = play_demos(
        cfg,
        tokenizer=tiny_tokenizer(),
        episodes=episodes,
        policy=policy,  # type: ignore[arg-type]
        seed=3,
        config_dir=config_dir,
    )
    return cfg, demos


def sft_examples_of(rows: list[dict[str, Any]], tokenizer: Any, tmp_path: Path) -> list[Any]:
    """The rows written as `rlvr env demos` writes them, read back by the SFT loader."""
    path = tmp_path / "demos.jsonl"
    write_rows(rows, path)
    return sft_examples(
        tokenizer, load_rows(path), source="demos", max_length=4096, truncate=False,
        assistant_only=True,
    )  # fmt: skip


def legal(name: str, step: EnvStep, turn: int) -> bool:
    """The env read the turn as a legal, well-formed action."""
    if name in ("frozenlake", "sokoban", "bandit"):
        return step.rewards.get("invalid_action", 0.0) == 0.0
    if name in ("sudoku", "countdown"):
        return bool(step.info["parsed"])
    assert name == "calculator"  # a call that ran, then a tagged answer
    if turn == 0:
        return step.info.get("tool_calls") == 1 and not step.info.get("tool_failures")
    return step.rewards["format"] == 1.0


@pytest.mark.parametrize(
    "name", ["frozenlake", "sokoban", "sudoku", "countdown", "bandit", "calculator"]
)
def test_random_demos_are_legal_actions_on_train_instances_only(name: str) -> None:
    cfg, demos = demos_of(name)
    splits = load_tasks(cfg.task)
    train = {t.id: t for t in splits.train}
    heldout = {t.id for t in splits.heldout}
    assert len(demos.rows) == 12 and demos.policy == "random"
    family = get_env_family(name, cfg.task.env.options)
    for row in demos.rows:
        assert row["task_id"] in train and row["task_id"] not in heldout
        # the split's own side test (by the family's split key: room, lake, answer grid...)
        key = family.split_key(train[row["task_id"]])
        assert stable_fraction(key) >= cfg.task.env.heldout_fraction
        # Replay the row's assistant turns in a fresh env: none is an invalid action.
        env = family.make(train[row["task_id"]])
        env.reset()
        turns = [
            m["content"] for m in row["messages"][row["train_from"] :] if m["role"] == "assistant"
        ]
        assert len(turns) == row["turns"] >= 1
        for k, text in enumerate(turns):
            step = env.step(text)
            assert legal(name, step, k), (name, text, step)
    # Random play rarely wins a grid game: the rows teach the format, not the task.
    if name in ("frozenlake", "sudoku", "countdown"):
        assert demos.success_rate <= 0.25


def test_random_choices_differ_between_episodes_and_seeds() -> None:
    _, a = demos_of("frozenlake", "random", 12)
    firsts = {r["messages"][2]["content"] for r in a.rows}
    assert len(firsts) >= 3  # not one move copied everywhere
    cfg, config_dir = demo_config(str(EXAMPLES / "env_frozenlake.yaml"), ROOMY)
    again = play_demos(cfg, tokenizer=tiny_tokenizer(), episodes=12, seed=3, config_dir=config_dir)
    other = play_demos(cfg, tokenizer=tiny_tokenizer(), episodes=12, seed=4, config_dir=config_dir)
    assert again.rows == a.rows  # seeded
    assert other.rows != a.rows


@pytest.mark.parametrize("name", ["frozenlake", "countdown", "calculator"])
def test_rows_are_the_engines_conversation_token_for_token(name: str, tmp_path: Path) -> None:
    """The SFT loader renders a row to the trajectory's own tokens, and trains exactly its sampled
    positions plus the template's newline after each end-of-turn token (glue in RL)."""
    _, demos = demos_of(name, "random", 8)
    tokenizer = tiny_tokenizer()
    examples = sft_examples_of(demos.rows, tokenizer, tmp_path)
    eos = tokenizer.eos_token_id
    for row, traj, example in zip(demos.rows, demos.trajectories, examples, strict=True):
        end = traj.turns[row["turns"] - 1].end  # through the last complete turn
        assert list(example.input_ids[:end]) == list(traj.token_ids[:end])
        trained = {t for t in range(end) if example.loss_mask[t]}
        sampled = {t for t in range(end) if traj.policy_mask[t]}
        assert sampled <= trained
        assert all(traj.token_ids[t - 1] == eos for t in trained - sampled)
    if name == "calculator":  # the opening's worked example is context, as in RL
        row = demos.rows[0]
        assert row["train_from"] > 0
        assert any(m["role"] == "assistant" for m in row["messages"][: row["train_from"]])
        assert "<tools>" in row["messages"][0]["content"]  # schemas as the engine wrote them


@pytest.mark.parametrize(("name", "keep"), [("frozenlake", 1), ("sokoban", 2), ("calculator", 1)])
def test_a_history_window_writes_a_row_per_turn_as_rl_samples_it(
    name: str, keep: int, tmp_path: Path
) -> None:
    """With `rollout.history: window`, RL trains each turn from the opening plus the last K turns,
    so each demonstrated turn is its own row: rendered by the SFT loader, it is that turn's sample
    (Trajectory.turn_samples) token for token, and only the turn's own tokens are trained."""
    window = ["rollout.history=window", f"rollout.history_turns={keep}"]
    _, demos = demos_of(name, "random", 6, *window)
    _, whole = demos_of(name, "random", 6)
    assert demos.per_turn and not whole.per_turn
    assert demos.episodes == whole.episodes  # the same episodes, cut differently
    assert len(demos.rows) == sum(e["turns"] for e in demos.episodes) > len(demos.episodes)
    tokenizer = tiny_tokenizer()
    examples = sft_examples_of(demos.rows, tokenizer, tmp_path)
    eos = tokenizer.eos_token_id
    for row, sample, example in zip(demos.rows, demos.trajectories, examples, strict=True):
        n = len(sample.token_ids)  # the SFT row adds the template's newline after EOS
        assert list(example.input_ids[:n]) == list(sample.token_ids)
        assert len(example.input_ids) - n <= 1
        trained = {t for t, m in enumerate(example.loss_mask) if m}
        sampled = {t for t, m in enumerate(sample.policy_mask) if m}
        assert sampled and sampled <= trained
        assert all(sample.token_ids[t - 1] == eos for t in trained - sampled)
        assert row["train_from"] == len(row["messages"]) - 1
    # Each row is its episode's whole conversation cut to: the opening, then the K turns before
    # the trained one (each an action and what followed it), then the trained turn.
    per_episode = iter(demos.rows)
    for conversation in whole.rows:
        n = conversation["train_from"]  # the opening's messages
        after = conversation["messages"][n:]
        actions = [i for i, m in enumerate(after) if m["role"] == "assistant"]
        for k in range(conversation["turns"]):
            row = next(per_episode)
            assert row["turn"] == k + 1 and row["messages"][:n] == conversation["messages"][:n]
            first = actions[max(0, k - keep)]
            assert row["messages"][n:] == after[first : actions[k] + 1]
    turns = [r["turn"] for r in demos.rows]
    assert turns.count(1) == len(demos.episodes) and max(turns) > keep  # windows that dropped turns


def test_a_history_window_with_noise_writes_rows_for_the_solvers_turns_only() -> None:
    cfg, config_dir = demo_config(
        str(EXAMPLES / "env_frozenlake.yaml"), [*ROOMY, "rollout.history=window"]
    )
    demos = play_demos(
        cfg, tokenizer=tiny_tokenizer(), episodes=24, policy="scripted", seed=3,
        config_dir=config_dir, noise=0.4,
    )  # fmt: skip
    noisy = sum(e["noise_turns"] for e in demos.episodes)
    assert noisy > 0
    assert len(demos.rows) == sum(e["turns"] for e in demos.episodes) - noisy
    assert all(r["messages"][-1].get("training", True) for r in demos.rows)


@pytest.mark.parametrize("name", ["frozenlake", "sokoban", "sudoku", "countdown", "bandit"])
def test_scripted_demos_solve_every_instance(name: str) -> None:
    _, demos = demos_of(name, "scripted", 6)
    assert demos.success_rate == 1.0 and {r["policy"] for r in demos.rows} == {"scripted"}


def test_noise_injects_random_turns_kept_as_untrained_context(tmp_path: Path) -> None:
    """DART: with noise, some turns are the random policy's, marked `training: false`; the SFT mask
    trains only the solver's turns, and a solver turn after a random one (a recovery) is trained."""
    cfg, config_dir = demo_config(str(EXAMPLES / "env_frozenlake.yaml"), ROOMY)
    demos = play_demos(
        cfg, tokenizer=tiny_tokenizer(), episodes=24, policy="scripted", seed=3,
        config_dir=config_dir, noise=0.4,
    )  # fmt: skip
    marked = [
        [
            m.get("training", True)
            for m in r["messages"][r["train_from"] :]
            if m["role"] == "assistant"
        ]
        for r in demos.rows
    ]
    rows_flags = zip(demos.rows, marked, strict=True)
    assert all(r["noise_turns"] == flags.count(False) for r, flags in rows_flags)
    assert all(any(flags) for flags in marked)  # a row of noise only is dropped, not written
    noisy = sum(flags.count(False) for flags in marked)
    total = sum(len(flags) for flags in marked)
    assert 0.2 < noisy / total < 0.6, (noisy, total)  # about the 0.4 asked for
    recoveries = sum(1 for flags in marked for a, b in itertools.pairwise(flags) if not a and b)
    assert recoveries > 0
    assert demos.summary()["demos/noise_turns"] == noisy / len(demos.rows)
    # The loader's mask: a marked turn's tokens are not trained, the solver's are.
    tokenizer = tiny_tokenizer()
    examples = sft_examples_of(demos.rows, tokenizer, tmp_path)
    for flags, traj, example in zip(marked, demos.trajectories, examples, strict=True):
        for flag, span in zip(flags, traj.turns, strict=False):  # the row may end before a cut turn
            sampled = [t for t in range(span.start, span.end) if traj.policy_mask[t]]
            assert sampled and all(example.loss_mask[t] == int(flag) for t in sampled)
    # The same episodes without noise are the plain solver's: no mark, every turn trained.
    plain = play_demos(
        cfg, tokenizer=tiny_tokenizer(), episodes=6, policy="scripted", seed=3,
        config_dir=config_dir,
    )  # fmt: skip
    assert all("noise_turns" not in r for r in plain.rows)
    assert not any("training" in m for r in plain.rows for m in r["messages"])


def test_noise_is_for_the_scripted_policy_only() -> None:
    cfg, config_dir = demo_config(str(EXAMPLES / "env_frozenlake.yaml"), ROOMY)
    with pytest.raises(ConfigError, match=r"noise 0\.3 is for policy scripted"):
        play_demos(cfg, tokenizer=tiny_tokenizer(), episodes=2, policy="random", noise=0.3,
                   config_dir=config_dir)  # fmt: skip


def test_slippery_frozenlake_solver_replans_from_the_lake_shown() -> None:
    _, demos = demos_of("frozenlake", "scripted", 12, "task.env.options.slippery=true")
    assert demos.success_rate > 0.0  # it follows the player where the ice took it


def test_a_turn_cut_by_the_token_budget_ends_the_row_before_it() -> None:
    # Char-level tokens: a turn is ~23, an observation ~140, so in 180 the second turn is cut.
    cfg, config_dir = demo_config(
        str(EXAMPLES / "env_frozenlake.yaml"),
        ["sampling.max_new_tokens=24", "rollout.max_total_tokens=180"],
    )
    demos = play_demos(cfg, tokenizer=tiny_tokenizer(), episodes=30, seed=0, config_dir=config_dir)
    assert demos.trimmed > 0 and demos.dropped_cut == 0
    for row in demos.rows:
        assert row["turns"] == 1 and row["messages"][-1]["role"] == "assistant"
        assert row["messages"][-1]["content"].endswith("</answer>")
    # A first turn longer than the turn cap: nothing left to demonstrate.
    cfg, config_dir = demo_config(
        str(EXAMPLES / "env_frozenlake.yaml"), ["sampling.max_new_tokens=10"]
    )
    demos = play_demos(cfg, tokenizer=tiny_tokenizer(), episodes=3, seed=0, config_dir=config_dir)
    assert demos.rows == [] and demos.dropped_cut == 3


def test_max_turns_caps_each_demonstration() -> None:
    _, demos = demos_of("sokoban", "random", 10, "rollout.max_turns=2")
    assert max(r["turns"] for r in demos.rows) <= 2


def test_a_family_without_the_hooks_is_told_what_to_define(tmp_path: Path) -> None:
    source = (
        "from rlvr.envs.base import EnvFamily, Env, EnvReset, EnvStep\n"
        "from rlvr.records import Task\n"
        "class E(Env):\n"
        "    def __init__(self, t): self.t = t\n"
        "    def reset(self): return EnvReset(list(self.t.messages))\n"
        "    def step(self, text): return EnvStep(rewards={'success': 0.0}, done=True)\n"
        "class Plain(EnvFamily):\n"
        "    name = 'plain'\n    description = 'x'\n"
        "    def generate(self, seed):\n"
        "        return Task(id=f'p{seed}', messages=({'role': 'user', 'content': str(seed)},))\n"
        "    def make(self, task): return E(task)\n"
    )
    (tmp_path / "plain_env.py").write_text(source)
    cfg, _ = demo_config(f"{tmp_path / 'plain_env.py'}:Plain", ["task.env.num_train=20"])
    for policy, needle in (("random", "random_action(task, messages, rng)"),
                           ("scripted", "scripted_action(task, messages)")):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(needle)) as err:
            play_demos(cfg, tokenizer=tiny_tokenizer(), episodes=1, policy=policy)  # type: ignore[arg-type]
        assert "\n" not in str(err.value)


def demos_cli(out: Path, tokenizer_dir: Path, *sets: str) -> tuple[Any, list[dict[str, Any]]]:
    """`rlvr env demos frozenlake` (5 episodes, seed 1) with `--set`s: its result and its rows."""
    overrides = [arg for name in sets for arg in ("--set", name)]
    result = CliRunner().invoke(
        app,
        ["env", "demos", "frozenlake", "--episodes", "5", "-o", str(out), "--seed", "1",
         *overrides, "--tokenizer", str(tokenizer_dir)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return result, [json.loads(line) for line in out.read_text().splitlines()]


def test_cli_writes_rows_and_says_what_they_teach(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "demos.jsonl"
    result, rows = demos_cli(out, tiny_model_dir, "task.env.options.size=5")
    assert "teaches the format only, not the task" in result.output
    assert len(rows) == 5 and all(r["task_id"].count("/") == 4 for r in rows)  # 5x5 lakes
    window, turns = demos_cli(out, tiny_model_dir, "rollout.history=window")
    assert len(turns) > 5 and {r["turn"] for r in turns} >= {1, 2}
    assert "wrote 5 demonstrations" in window.output
    assert f"{len(turns)} rows, one per turn (rollout.history window)" in window.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["frozenlake", "--policy", "clever"], "--policy 'clever': expected random or scripted"),
        (["nosuch"], "'nosuch' is not a known env"),
        (["calculator", "--policy", "scripted"], "has no scripted_action"),
        (["frozenlake", "--set", "task.env.options.sise=5"], "task.env.options.sise"),
        ([str(EXAMPLES / "quickstart.yaml")], "need a config with one env"),
        (["frozenlake", "--noise", "1.5"], "--noise 1.5: expected a chance in [0, 1)"),
    ],
)
def test_cli_errors_are_one_line(args: list[str], needle: str, tmp_path: Path) -> None:
    """The message `rlvr` prints as `error: ...` (cli.main), and no file written."""
    out = tmp_path / "x.jsonl"
    result = CliRunner().invoke(
        app, ["env", "demos", *args, "-o", str(out), "--tokenizer", "tiny-random"]
    )
    assert isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    assert needle in message and "\n" not in message
    assert not out.exists()


def test_cli_error_exit_code_and_stderr(tmp_path: Path) -> None:
    """An empty model cache, as on a fresh machine: the env name is refused before the bundled
    model's tokenizer is converted (which took ~20 s and drew a progress bar on stderr)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RLVR_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "rlvr.cli", "env", "demos", "nosuch", "-o", "never.jsonl"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert not (tmp_path / "cache" / "models").exists(), "no model was converted"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: task.env.name 'nosuch' is not a known")


@pytest.mark.parametrize("tool_format", ["llama3_json", "mistral"])
def test_tool_calls_are_written_in_the_format_the_engine_reads(tool_format: str) -> None:
    """random_action writes Hermes; the rows carry the call in rollout.tool_format, and the
    system message describes that format (the template ignores tools=, so rlvr writes it)."""
    from rlvr.envs.tool_formats import resolve_tool_format

    cfg, demos = demos_of("calculator", "random", 4, f"rollout.tool_format={tool_format}")
    train = {t.id: t for t in load_tasks(cfg.task).train}
    family = get_env_family("calculator", cfg.task.env.options)
    for row in demos.rows:
        turns = [
            m["content"] for m in row["messages"][row["train_from"] :] if m["role"] == "assistant"
        ]
        assert "<tool_call>" not in turns[0]
        env = family.make(train[row["task_id"]])
        env.tool_format = resolve_tool_format(tool_format, tiny_tokenizer())  # type: ignore[attr-defined]
        env.reset()
        assert legal("calculator", env.step(turns[0]), 0), turns[0]


def test_calculator_random_turns_call_then_answer_the_result() -> None:
    family = get_env_family("calculator", {"num_operations": 2})
    task: Task = family.generate(0)
    rng = random.Random(0)
    call = family.random_action(task, [], rng)  # type: ignore[attr-defined]
    assert call.startswith("<tool_call>\n") and '"name": "calculator"' in call
    messages = [{"role": "assistant", "content": call}, {"role": "tool", "content": "1234"}]
    assert family.random_action(task, messages, rng) == "<answer>1234</answer>"  # type: ignore[attr-defined]


def _first_call_expression(family: Any, task: Task, seed: int) -> str:
    call = family.random_action(task, [], random.Random(seed))
    assert call.startswith("<tool_call>\n") and call.endswith("\n</tool_call>")
    return str(json.loads(call.split("\n")[1])["arguments"]["expression"])


def test_calculator_random_call_uses_every_number_of_a_three_number_question() -> None:
    """On a 2-operation question (three numbers) the first call is one expression over all three,
    in a random order with random operators and grouping, which the calculator evaluates; a
    2-number question keeps `a op b` with the same random draws as before. Not one call on two
    of the numbers: that demo teaches the collapse RL fell into on 2-operation problems."""
    from rlvr.envs.calculator import evaluate_arithmetic

    family = get_env_family("calculator", {"num_operations": 2})
    task: Task = family.generate(0)
    numbers = sorted(re.findall(r"\d+", str(task.messages[-1]["content"])))
    assert len(numbers) == 3
    shapes = set()
    for seed in range(200):
        expression = _first_call_expression(family, task, seed)
        assert sorted(re.findall(r"\d+", expression)) == numbers, expression  # each once
        evaluate_arithmetic(expression)  # parses and evaluates: no ValueError
        shapes.add(re.sub(r"\d+", "n", expression))
    assert len(shapes) >= 2 and any(s.startswith("n ") for s in shapes), shapes
    assert any(s.startswith("(") for s in shapes), shapes  # both groupings occur

    one_op = get_env_family("calculator", {"num_operations": 1})
    for seed in range(50):
        two: Task = one_op.generate(seed)
        question = re.findall(r"\d+", str(two.messages[-1]["content"]))
        assert len(question) == 2
        rng = random.Random(seed)
        a, b = rng.sample(question, 2)  # the previous policy, draw for draw
        assert _first_call_expression(one_op, two, seed) == f"{a} {rng.choice('+-*')} {b}"


def test_calculator_random_call_rarely_solves_two_operation_problems() -> None:
    """A format warm-up must not be a solver. Measured: the random expression over every number
    equals the answer on 22 of 500 train 2-operation tasks (4.4%); 1-operation ones, 31%
    (unchanged: two numbers, one operator)."""
    from rlvr.envs.calculator import evaluate_arithmetic

    family = get_env_family("calculator", {"num_operations": 2})
    train, _ = family.make_splits(500, 0)
    hits = sum(
        evaluate_arithmetic(_first_call_expression(family, task, seed)) == task.fields["answer"]
        for seed, task in enumerate(train)
    )
    assert hits / len(train) < 0.5


def test_a_pipeline_warms_up_on_env_demos_then_runs_rl(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """An sft stage with `env_demos:` plays the RL stage's env on its train split, trains on the
    rows, and hands its model to the RL stage; `stop_before` runs the warm-up alone first (what
    benchmarks/efficacy.py does to time it), and the rerun continues with RL."""
    from rlvr.pipeline import PipelineConfig, run_pipeline

    rl_config = {
        "model": {"bf16": "off"},
        "task": {"source": "env", "env": {"name": "frozenlake", "num_train": 40, "num_heldout": 4}},
        "sampling": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 24},
        "rollout": {"max_turns": 2, "max_total_tokens": 400},
        "train": {"steps": 1},
        "eval": {"at_start": False, "at_end": False},
        "tracking": {"trackio": False, "progress": False},
    }
    sft_config = {
        "model": {"bf16": "off"},
        "data": {"heldout_fraction": 0.1},
        "train": {"steps": 3, "batch_size": 4, "micro_batch_size": 4, "learning_rate": 1.0e-3,
                  "max_length": 2048},
        "progress": False,
    }  # fmt: skip
    cfg = PipelineConfig.model_validate(
        {
            "model": str(tiny_model_dir),
            "output_dir": str(tmp_path / "run"),
            "eval": {"each_stage": True, "n": 2},
            "stages": [
                {
                    "name": "format",
                    "kind": "sft",
                    "config": sft_config,
                    "env_demos": {"episodes": 20, "max_turns": 2},
                },
                {"name": "rl", "kind": "rl", "config": rl_config},
            ],
        }
    )
    warm = run_pipeline(cfg, config_dir=tmp_path, echo=lambda _: None, stop_before="rl")
    assert [r["stage"] for r in warm] == ["start", "format"]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "format" / "demos.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(r["policy"] == "random" and r["turns"] <= 2 for r in rows)
    heldout = {t.id for t in load_tasks(TaskConfig.model_validate(rl_config["task"])).heldout}
    assert not heldout & {r["task_id"] for r in rows}
    sft_cfg = json.loads((run / "format" / "config.json").read_text())
    assert sft_cfg["data"]["path"] == str(run / "format" / "demos.jsonl")
    metrics = warm[-1]["metrics"]
    assert metrics["demos/rows"] == 20.0 and "loss" in metrics and warm[-1]["wall_minutes"] > 0
    assert warm[-1]["heldout_accuracy"] is not None  # the warm-up's own held-out number

    rows_all = run_pipeline(cfg, config_dir=tmp_path, echo=lambda _: None)
    assert [r["stage"] for r in rows_all] == ["start", "format", "rl"]
    rl_cfg = (run / "rl" / "config.yaml").read_text()
    assert str(run / "format" / "model") in rl_cfg  # RL started from the warm-up's model


def test_pipeline_config_errors_for_env_demos(tmp_path: Path) -> None:
    from rlvr.pipeline import PipelineConfig, check_stages

    base = {"name": "format", "kind": "sft", "env_demos": {"episodes": 4}}
    with pytest.raises(ValueError, match="env_demos is for kind sft"):
        PipelineConfig.model_validate({"stages": [{**base, "kind": "dpo"}]})
    with pytest.raises(ValueError, match=r"env_demos replaces data\.path"):
        PipelineConfig.model_validate(
            {"stages": [{**base, "config": {"data": {"path": "a.jsonl"}}}]}
        )
    alone = PipelineConfig.model_validate({"stages": [base]})
    with pytest.raises(ConfigError, match="env_demos needs `config:`"):
        check_stages(alone, tmp_path)


def test_the_documented_command_runs_on_the_doc_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/envs.md's `rlvr env demos my_envs.py:GuessFamily ...` line, with its random_action."""
    doc = (EXAMPLES.parent / "docs" / "envs.md").read_text()
    (tmp_path / "my_envs.py").write_text(
        "\n\n".join(re.findall(r"```python\n(.*?)```", doc, re.DOTALL))
    )
    [commands] = re.findall(r"```sh\n(.*?)```", doc, re.DOTALL)
    line = next(c for c in commands.splitlines() if "GuessFamily" in c)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, line.split()[1:])
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (tmp_path / "guess_demos.jsonl").read_text().splitlines()]
    assert len(rows) == 32
    turns = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert all(re.fullmatch(r"<guess>\d+</guess>", t) for t in turns)
