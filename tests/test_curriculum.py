"""Curricula (rlvr.train.curriculum): the promotion rule by hand, the config's one-line errors, levels
that rebuild an env's tasks (the calculator's 1 -> 2 operations), scheduled mixture weights, and on
the tiny model: promotion when the rolling success crosses the threshold, and an exact resume.

The loop tests pin `model.bf16: off` (no `precision` mark needed: they never ask the CPU)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from pydantic import Field

from rlvr.config import RunConfig, load_config
from rlvr.envs import Env, EnvFamily, EnvReset, EnvStep
from rlvr.envs.base import ENV_FAMILIES, EnvOptions
from rlvr.envs.calculator import _PROBLEMS
from rlvr.errors import ConfigError
from rlvr.observe.metrics import WALL_CLOCK_METRICS
from rlvr.observe.report import write_report
from rlvr.observe.tracking import read_metrics
from rlvr.records import Task, Trajectory
from rlvr.train.curriculum import (
    PROMOTED,
    Curriculum,
    LevelState,
    PromotionRule,
    advance,
    level_history,
)
from rlvr.train.sources import Sources


# ------------------------------------------------------------------------------ the rule, by hand
def test_promotion_rule_by_hand() -> None:
    rule = PromotionRule(num_levels=3, threshold=0.5, window=2, min_steps=2)
    # step 1: mean(0.2) = 0.2; step 2: mean(0.2, 0.9) = 0.55 after 2 steps -> level 1 from step 3;
    # step 3: one step at level 1 (< min_steps); step 4: mean(0.4, 0.7) = 0.55 -> level 2 from step
    # 5; the last level is never left.
    assert level_history([0.2, 0.9, 0.4, 0.7, 1.0, 1.0, 0.0], rule) == [0, 0, 1, 1, 2, 2, 2]


def test_the_window_forgets_older_steps() -> None:
    rule = PromotionRule(num_levels=2, threshold=0.5, window=2, min_steps=1)
    # A running mean over all steps would be 0.25 at step 4; the last two steps' mean is 0.5.
    assert level_history([0.0, 0.0, 0.0, 1.0, 0.0], rule) == [0, 0, 0, 0, 1]


def test_min_steps_per_level_holds_a_level_past_a_full_window() -> None:
    rule = PromotionRule(num_levels=2, threshold=0.5, window=1, min_steps=3)
    assert level_history([1.0, 1.0, 1.0, 1.0], rule) == [0, 0, 0, 1]


def test_steps_without_a_value_are_not_counted() -> None:
    rule = PromotionRule(num_levels=2, threshold=0.5, window=2, min_steps=2)
    # Step 2 drew no episode of the source (None) and step 3 a NaN: neither counts.
    assert level_history([1.0, None, math.nan, 1.0, 0.0], rule) == [0, 0, 0, 0, 1]


def test_the_window_starts_afresh_at_each_level() -> None:
    rule = PromotionRule(num_levels=3, threshold=0.5, window=3, min_steps=1)
    # Promoted after step 1; at level 1 the window holds only level-1 steps: mean(0.0) then
    # mean(0.0, 0.4) = 0.2 (carrying step 1's 1.0 over would give 0.5 and promote again).
    assert level_history([1.0, 0.0, 0.4, 0.0], rule) == [0, 1, 1, 1]


def test_advance_reports_the_success_it_judged_and_promotes_at_the_threshold() -> None:
    rule = PromotionRule(num_levels=2, threshold=0.5, window=4, min_steps=2)
    state, promoted, success = advance(LevelState(), 0.25, rule)
    assert (state, promoted, success) == (LevelState(0, 1, (0.25,)), False, 0.25)
    state, promoted, success = advance(state, 0.75, rule)  # mean exactly 0.5: promoted
    assert (state, promoted, success) == (LevelState(1, 0, ()), True, 0.5)
    same, promoted, success = advance(state, None, rule)
    assert same == state and not promoted and math.isnan(success)


# ------------------------------------------------------------------------------ config and levels
def calculator_config(tmp_path: Path, curriculum: dict[str, Any], **extra: Any) -> RunConfig:
    data = {
        "model": {"name": "tiny-random", "bf16": "off"},
        "task": {
            "source": "env",
            "env": {
                "name": "calculator",
                "options": {"num_operations": 2},
                "num_train": 60,
                "num_heldout": 20,
            },
        },
        "curriculum": curriculum,
        **extra,
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def curriculum_of(tmp_path: Path, curriculum: dict[str, Any], **extra: Any) -> Curriculum:
    cfg = calculator_config(tmp_path, curriculum, **extra)
    return Curriculum(cfg, Sources(cfg))


TWO_LEVELS = {"levels": [{"num_operations": 1}, {"num_operations": 2}]}


@pytest.mark.parametrize(
    ("curriculum", "extra", "message"),
    [
        ({"levels": [{"num_operations": 1}]}, {}, "curriculum.levels needs at least two levels"),
        ({**TWO_LEVELS, "source": "other"}, {}, "curriculum.source 'other' is not a task source"),
        ({"metric": "success"}, {}, "read only with curriculum.levels"),
        (
            {"schedule": [{"step": 0, "weights": {"main": 1.0}}]},
            {},
            "curriculum.schedule sets mixture weights: the run has no mixture",
        ),
        (TWO_LEVELS, {"rollout": {"async_rollouts": True}}, "rollout.async_rollouts"),
        ({"levels": [{}, {}], "window": 0}, {}, "'curriculum.window'"),
    ],
)
def test_config_errors_are_one_line(
    tmp_path: Path, curriculum: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        calculator_config(tmp_path, curriculum, **extra)
    assert "\n" not in str(err.value)


def test_mixture_errors(tmp_path: Path) -> None:
    def mixture(curriculum: dict[str, Any]) -> None:
        env = {"name": "calculator", "num_train": 60, "num_heldout": 20}
        data = {
            "mixture": [
                {"name": "easy", "task": {"source": "env", "env": env}},
                {"name": "sums", "task": {"source": "arithmetic"}},
            ],
            "curriculum": curriculum,
        }
        (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
        load_config(tmp_path / "m.yaml")

    with pytest.raises(ConfigError, match="name the mixture component the levels apply to"):
        mixture(TWO_LEVELS)
    with pytest.raises(ConfigError, match="source 'sums' is no env"):
        mixture({**TWO_LEVELS, "source": "sums"})
    with pytest.raises(ConfigError, match=r"schedule.0.weights: unknown source 'hard'"):
        mixture({"schedule": [{"step": 0, "weights": {"hard": 1.0}}]})
    with pytest.raises(ConfigError, match=r"schedule steps must increase: \[3, 1\]"):
        mixture({"schedule": [{"step": 3, "weights": {}}, {"step": 1, "weights": {}}]})
    with pytest.raises(ConfigError, match=r"need >= 0 and one > 0"):
        mixture({"schedule": [{"step": 0, "weights": {"easy": 0.0, "sums": 0.0}}]})


def test_level_options_are_checked_against_the_env_family(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        curriculum_of(tmp_path, {"levels": [{"num_operations": 1}, {"num_operaions": 2}]})
    assert str(err.value) == (
        "curriculum.levels.1: 'num_operaions' is not an option of env 'calculator' "
        "(options: num_operations, max_operand, demonstration)"
    )
    with pytest.raises(ConfigError, match=r"^curriculum.levels.1.num_operations: .*less than or"):
        curriculum_of(tmp_path, {"levels": [{"num_operations": 1}, {"num_operations": 4}]})
    with pytest.raises(ConfigError, match=r"curriculum.metric 'solved' is not a reward component"):
        curriculum_of(tmp_path, {**TWO_LEVELS, "metric": "solved"})


def operations(task: Task) -> int:
    """How many operations the calculator question of `task` needs (by its template)."""
    question = task.messages[-1]["content"]
    for n, problems in _PROBLEMS.items():
        for template, _ in problems:
            pattern = re.escape(template).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+")
            if re.fullmatch(pattern.replace(r"\{c\}", r"\d+"), question):
                return n
    raise AssertionError(f"not a calculator question: {question!r}")


def episode(task: Task, success: float, source: str = "main") -> Trajectory:
    return Trajectory(
        task_id=task.id, token_ids=(1, 2), policy_mask=(0, 1), logprobs=(0.0, -1.0),
        prompt_length=1, completion_text="", finish_reason="stop",
        rewards={"success": success, "format": 1.0, "used_tool": 1.0}, reward=success,
        source=source,
    )  # fmt: skip


@pytest.mark.parametrize("eval_level", ["final", "current"])
def test_calculator_levels_rebuild_train_and_heldout_tasks(tmp_path: Path, eval_level: str) -> None:
    """1 -> 2 operations: train tasks follow the level; held-out ones are the final level's
    (eval_level final) or follow the level (current); the two never share an instance."""
    cur = curriculum_of(
        tmp_path, {**TWO_LEVELS, "threshold": 0.5, "window": 2, "eval_level": eval_level}
    )
    source = cur.sources.by_name["main"]
    assert {operations(t) for t in source.splits.train} == {1}
    assert {operations(t) for t in source.splits.heldout} == {2 if eval_level == "final" else 1}
    tasks = cur.sources.next_batch(4)
    assert {operations(t) for t in tasks} == {1}

    metrics: dict[str, Any] = {}
    assert cur.after_step(1, [episode(t, 0.25) for t in tasks], metrics) == []
    assert metrics == {"curriculum/level": 0, "curriculum/success": 0.25}
    # An episode of another source is not this source's success.
    events = cur.after_step(2, [episode(t, 1.0) for t in tasks] + [episode(tasks[0], 0, "x")], {})
    assert [e["event"] for e in events] == [PROMOTED]
    assert events[0]["evidence"] == {
        "from_level": 0, "to_level": 1, "success": 0.625, "steps_at_level": 2
    }  # fmt: skip
    source = cur.sources.by_name["main"]
    assert len(source.splits.train) == 60 and {operations(t) for t in source.splits.train} == {2}
    assert {operations(t) for t in source.splits.heldout} == {2}
    assert not {t.id for t in source.splits.train} & {t.id for t in source.splits.heldout}
    assert {operations(t) for t in cur.sources.next_batch(8)} == {2}
    assert cur.state_dict() == {"level": 1, "steps": 0, "recent": []}


def test_scheduled_mixture_weights(tmp_path: Path) -> None:
    data = {
        "mixture": [
            {"name": "ones", "task": {"source": "arithmetic", "arithmetic": {"digits": 1}}},
            {"name": "twos", "task": {"source": "arithmetic", "arithmetic": {"digits": 2}}},
        ],
        "curriculum": {
            "schedule": [
                {"step": 0, "weights": {"twos": 0.0}},
                {"step": 3, "weights": {"ones": 0.0}},
            ]
        },
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(tmp_path / "m.yaml")
    sources = Sources(cfg)
    cur = Curriculum(cfg, sources)
    drawn = {}
    for step in (1, 2, 3, 4):
        cur.before_step(step)
        drawn[step] = {t.source for t in sources.next_batch(16)}
        metrics: dict[str, Any] = {}
        cur.after_step(step, [], metrics)
        assert metrics == {
            "curriculum/weight/ones": 1.0 if step < 3 else 0.0,
            "curriculum/weight/twos": 0.0 if step < 3 else 1.0,
        }
    assert drawn == {1: {"ones"}, 2: {"ones"}, 3: {"twos"}, 4: {"twos"}}


# ------------------------------------------------------------------------------ in the loop
class LevelsOptions(EnvOptions):
    rung: int = Field(0, ge=0, description="The level's number (in every task id).")
    bonus: float = Field(0.0, ge=0.0, description="Added to success (1.0: always succeeds).")


class LevelsEnv(Env):
    def __init__(self, task: Task) -> None:
        self.task = task

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        text = assistant_text.strip()
        digits = sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
        success = min(1.0, digits + float(self.task.fields["bonus"]))
        return EnvStep(rewards={"digits": digits, "success": success}, done=True)


class LevelsFamily(EnvFamily):
    """Reply in digits; `success` is the digit share plus `bonus` (so a level can be passed at will)
    and is logged only; `digits` is what the policy is trained on."""

    name = "tiny_levels"
    description = "Digits at a level; success = digit share + bonus."
    Options = LevelsOptions
    reward_weights: ClassVar[dict[str, float]] = {"digits": 1.0, "success": 0.0}

    def generate(self, seed: int) -> Task:
        o = self.options
        assert isinstance(o, LevelsOptions)
        return Task(
            id=f"rung{o.rung}:{seed}",
            messages=({"role": "user", "content": f"Level {o.rung}: say {seed}."},),
            fields={"rung": o.rung, "bonus": o.bonus},
        )

    def make(self, task: Task) -> Env:
        return LevelsEnv(task)


@pytest.fixture()
def levels_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlvr.envs.catalog  # noqa: F401  (the built-ins first)

    monkeypatch.setitem(ENV_FAMILIES, "tiny_levels", LevelsFamily)


def tiny_levels_config(
    model_dir: Path,
    out: Path,
    curriculum: dict[str, Any],
    sampling: dict[str, Any] | None = None,
    **train: Any,
) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"name": str(model_dir), "bf16": "off"},
            "task": {"source": "env", "env": {"name": "tiny_levels", "num_train": 64, "num_heldout": 8}},
            "curriculum": curriculum,
            "sampling": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, "temperature": 1.0, **(sampling or {})},
            "train": {"learning_rate": 3e-3, "micro_batch_size": 8, **train},
            "eval": {"n": 4, "every": 0, "at_start": False},
            "checkpoint": {"every": 2},
            "monitors": {"enabled": False},
            "tracking": {"trackio": False, "progress": False},
            "output_dir": str(out),
        }
    )  # fmt: skip


def step_rows(run: Path) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for m in read_metrics(run):
        rows.setdefault(m["step"], {}).update(
            {k: v for k, v in m.items() if k not in WALL_CLOCK_METRICS}
        )
    return rows


def task_ids(run: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in (run / "rollouts.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row["task_id"])
    return out


def test_promotion_when_the_rolling_success_crosses_the_threshold(
    levels_env: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Success is the share of digits the tiny model writes (it learns to write more); the run
    moves to level 1 at the first step whose rolling success reaches the threshold, computed here
    again from the `rewards/success/mean` series alone, and its tasks are level 1's from then on."""
    from rlvr.train.loop import train

    curriculum = {"levels": [{"rung": 0}, {"rung": 1}], "threshold": 0.3, "window": 3}
    sampling = {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 16}
    cfg = tiny_levels_config(tiny_model_dir, tmp_path / "run", curriculum, sampling, steps=16)
    summary = train(cfg)
    rows = [m for m in read_metrics(summary.run_dir) if "reward" in m]
    successes = [m["rewards/success/mean"] for m in rows]
    levels = [m["curriculum/level"] for m in rows]
    rule = PromotionRule(num_levels=2, threshold=0.3, window=3, min_steps=3)
    assert levels == level_history(successes, rule)
    assert successes[0] < 0.3 and 0 in levels and 1 in levels  # crossed, not started above
    promoted_at = levels.index(1)  # the last step at level 0 (1-based step numbers)
    assert sum(successes[promoted_at - 3 : promoted_at]) / 3 >= 0.3
    events = [m for m in read_metrics(summary.run_dir) if m.get("event") == PROMOTED]
    assert [(e["step"], e["evidence"]["to_level"]) for e in events] == [(promoted_at, 1)]
    for step, ids in task_ids(summary.run_dir).items():
        rung = 0 if step <= promoted_at else 1
        assert all(i.startswith(f"rung{rung}:") for i in ids), (step, ids)


def test_resume_restores_the_level_window_and_sampler_exactly(
    levels_env: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Levels 0 and 1 pay success 1.0 (bonus): each is left after min_steps_per_level = 3 steps, at
    steps 3 and 6. The split run stops after step 4 (level 1, one step into its window, its rebuilt
    sampler 2 tasks in) and resumes: every metric, event and task must equal the uninterrupted run's."""
    from rlvr.train.loop import train

    curriculum = {
        "levels": [{"rung": 0, "bonus": 1.0}, {"rung": 1, "bonus": 1.0}, {"rung": 2}],
        "threshold": 0.9, "window": 2, "min_steps_per_level": 3,
    }  # fmt: skip
    full = train(tiny_levels_config(tiny_model_dir, tmp_path / "full", curriculum, steps=8, seed=3))

    class Stop(Exception):
        pass

    def stop_after_4(step: int, _metrics: dict[str, object]) -> None:
        if step == 4:
            raise Stop

    cfg = tiny_levels_config(tiny_model_dir, tmp_path / "split", curriculum, steps=8, seed=3)
    with pytest.raises(Stop):
        train(cfg, on_step_end=stop_after_4)
    state = json.loads((tmp_path / "split/checkpoints/step-000004/state.json").read_text())
    assert state["curriculum"] == {"level": 1, "steps": 1, "recent": [1.0]}
    train(cfg, resume=True)

    a, b = step_rows(full.run_dir), step_rows(tmp_path / "split")
    assert [a[s]["curriculum/level"] for s in range(1, 9)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert {s: a[s].get("event") for s in (3, 6)} == {3: PROMOTED, 6: PROMOTED}
    for step in range(1, 9):
        assert a[step] == b[step], f"step {step} differs after resume"
    assert task_ids(full.run_dir) == task_ids(tmp_path / "split")
    for step, ids in task_ids(full.run_dir).items():
        assert all(i.startswith(f"rung{a[step]['curriculum/level']}:") for i in ids)
    # `rlvr report` plots the level, with the two promotions marked on that plot.
    page = write_report(full.run_dir).read_text()
    assert re.search(r'data-alert-markers="2"><img src="curriculum.png"', page)


def test_report_marks_promotions_on_the_curriculum_plot_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rows: list[dict[str, Any]] = []
    for step in range(1, 7):
        rows.append(
            {"step": step, "reward": 0.1 * step, "curriculum/level": int(step > 3),
             "curriculum/success": 0.2 * (step % 4)}
        )  # fmt: skip
        if step == 3:
            rows.append({"step": 3, "event": PROMOTED, "action": "promote", "message": "0 -> 1"})
        if step == 5:
            rows[-1]["alerts/entropy_collapse"] = 1.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(run).read_text()
    # Each plot is marked once: the reward plot by the alert, the curriculum plot by the promotion.
    plots = re.findall(r'data-alert-markers="(\d+)"><img src="([a-z_]+).png"', page)
    assert {png: n for n, png in plots} == {"reward": "1", "curriculum": "1"}
    table = page.split('id="alerts"')[1]
    assert "entropy_collapse" in table and PROMOTED not in table


def test_the_calculator_curriculum_example_builds() -> None:
    """examples/env_calculator_curriculum.yaml: 1-operation train tasks first, 2-operation held-out
    tasks (its final level) from the start."""
    path = Path(__file__).resolve().parent.parent / "examples" / "env_calculator_curriculum.yaml"
    cfg = load_config(path, ["task.env.num_train=40", "task.env.num_heldout=10"])
    cur = Curriculum(cfg, Sources(cfg, path.parent))
    assert cur.levels == [{**cfg.task.env.options, "num_operations": n} for n in (1, 2)]  # type: ignore[union-attr]
    source = cur.sources.by_name["main"]
    assert {operations(t) for t in source.splits.train} == {1}
    assert {operations(t) for t in source.splits.heldout} == {2}
