"""Every built-in env through the common protocol, every example config, mixtures and `rlvr envs`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlvr.config import load_config
from rlvr.envs import ENV_FAMILIES, EnvFamily, get_env_family
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.tasks import TaskSampler, TaskSplits
from rlvr.train.sources import Sources

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BUILT_IN = ["bandit", "calculator", "code", "countdown", "frozenlake", "sokoban", "sudoku"]


def test_every_built_in_env_is_registered() -> None:
    get_env_family("calculator")
    assert sorted(ENV_FAMILIES) == BUILT_IN


@pytest.mark.parametrize("name", BUILT_IN)
def test_env_plays_through_the_protocol(name: str) -> None:
    family = get_env_family(name)
    train, heldout = family.make_splits(30, 8, 0.25)
    assert len(train) == 30 and len(heldout) == 8  # code has a fixed set of 50 tasks
    assert not {t.id for t in train} & {t.id for t in heldout}
    task = heldout[0]
    env = family.make(task)
    opening = env.reset()
    assert [m["content"] for m in opening.messages] == [m["content"] for m in task.messages]
    # Nonsense is answered, not crashed on, and never counts as success.
    step = env.step("I am not sure what to do here.")
    assert step.rewards.get(family.success_metric, 0.0) == 0.0
    assert env.max_turns >= 1
    assert Path(EXAMPLES.parent / family.example_config).is_file()


@pytest.mark.parametrize("name", BUILT_IN)
def test_env_split_is_seed_independent_and_stable(name: str) -> None:
    a = get_env_family(name).make_splits(30, 5, 0.25)
    b = get_env_family(name).make_splits(30, 5, 0.25)
    assert [t.id for t in a[1]] == [t.id for t in b[1]]


def test_unknown_env_and_bad_options_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"not a known env.*calculator"):
        get_env_family("no_such_env")
    with pytest.raises(ConfigError, match="num_operations"):
        get_env_family("calculator", {"num_operations": 9})
    with pytest.raises(ConfigError, match=r"task\.env\.options"):
        get_env_family("calculator", {"typo": 1})


def test_a_user_env_family_loads_from_a_file() -> None:
    family = get_env_family(f"{EXAMPLES / 'tiny_envs.py'}:DigitsFamily")
    assert isinstance(family, EnvFamily)
    env = family.make(family.generate(3))
    step = env.step("12ab")
    assert step.rewards == {"digits": 0.5 / 3} and not step.done
    with pytest.raises(ConfigError, match="not an EnvFamily"):
        get_env_family(f"{EXAMPLES / 'tiny_envs.py'}:digit_fraction")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads(path: Path) -> None:
    if "stages" in (yaml.safe_load(path.read_text()) or {}):  # a pipeline, not a train config
        from rlvr.pipeline import check_stages, load_pipeline_config

        check_stages(load_pipeline_config(path), path.parent)  # every stage's own config, too
        return
    cfg = load_config(path)
    assert cfg.components()


def test_rlvr_envs_lists_each_env_on_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlvr.cli", "envs"], capture_output=True, text=True, check=True
    ).stdout
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == BUILT_IN
    assert all("examples/env_" in line for line in lines)


# ---------------------------------------------------------------------------------------------- mixtures
def test_mixture_draws_sources_by_weight_with_their_own_rubrics() -> None:
    cfg = load_config(EXAMPLES / "mixture.yaml")
    sources = Sources(cfg, EXAMPLES)
    assert [s.name for s in sources] == ["calculator", "arithmetic"]
    calc, arith = sources.by_name["calculator"], sources.by_name["arithmetic"]
    assert calc.scoring.rubric is None and calc.metric == "success"
    assert arith.scoring.rubric is not None and arith.metric == "correct"
    batch = sources.next_batch(600)
    share = sum(t.source == "calculator" for t in batch) / len(batch)
    assert 0.6 < share < 0.73  # weights 2:1
    assert all(sources.of(t).name == t.source for t in batch[:20])


def test_mixture_state_round_trips() -> None:
    cfg = load_config(EXAMPLES / "mixture.yaml")
    a = Sources(cfg, EXAMPLES)
    a.next_batch(7)
    state = a.state_dict()
    state = json.loads(json.dumps(state))  # checkpoints store it as JSON
    expected = [t.id for t in a.next_batch(9)]
    b = Sources(cfg, EXAMPLES)
    b.load_state_dict(state)
    assert [t.id for t in b.next_batch(9)] == expected


def test_mixture_config_errors_are_one_line() -> None:
    base = EXAMPLES / "mixture.yaml"
    with pytest.raises(ConfigError, match="either mixture or task"):
        load_config(base, ["task.source=arithmetic"])
    with pytest.raises(ConfigError, match="rewards is empty"):
        load_config(None, ["task.source=arithmetic", "rewards=[]"])
    with pytest.raises(ConfigError, match=r"task\.env is missing"):
        load_config(None, ["task.source=env"])


def test_train_tasks_override_is_single_source_only() -> None:
    cfg = load_config(EXAMPLES / "mixture.yaml")
    splits = TaskSplits(train=[Task("a", ())], heldout=[Task("b", ())])
    with pytest.raises(ConfigError, match="not a mixture"):
        Sources(cfg, EXAMPLES, tasks=splits)
    assert TaskSampler(splits.train, seed=0).next_batch(1)[0].id == "a"


def test_a_saved_mixture_config_loads_back(tmp_path: Path) -> None:
    """The run directory's config.yaml is what --resume and `rlvr eval RUN_DIR` read."""
    import yaml

    from rlvr.config import config_to_dict

    cfg = load_config(EXAMPLES / "mixture.yaml")
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    assert load_config(saved) == cfg


def test_filter_and_env_config_combinations_are_checked() -> None:
    with pytest.raises(ConfigError, match="dynamic_sampling needs something to filter"):
        load_config(None, ["filter.dynamic_sampling=true"])
    assert load_config(None, ["filter.dynamic_sampling=true", "filter.drop_zero_std=true"])
    with pytest.raises(ConfigError, match="system_prompt is not used by an env"):
        load_config(None, ["task.source=env", "task.env.name=bandit", "task.system_prompt=hi"])
