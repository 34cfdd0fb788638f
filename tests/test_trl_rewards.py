"""TRL-style reward functions (issue 19, item 3): TRL's batch signature, its None semantics, and
examples/from_trl.yaml (the rlvr side of docs/coming_from_trl.md) trained on the tiny model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from rlvr.build import build_rubric
from rlvr.config import RewardSpec, load_config
from rlvr.errors import ConfigError
from rlvr.evaluate import check_error_fraction
from rlvr.records import Task, Trajectory
from rlvr.rollout.engine import rollout_groups
from rlvr.rollout.generator import SamplingParams
from rlvr.verifiers import RewardFunction, Rubric
from test_verifiers import make_trajectory  # the shared one-turn trajectory builder

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def make_task(task_id: str, **fields: Any) -> Task:
    return Task(id=task_id, messages=({"role": "user", "content": f"q {task_id}"},), fields=fields)


def pairs_of(*rows: tuple[str, dict[str, Any]]) -> list[tuple[Trajectory, Task]]:
    return [
        (make_trajectory(text, f"t{i}"), make_task(f"t{i}", **fields))
        for i, (text, fields) in enumerate(rows)
    ]


def test_a_trl_function_is_called_once_per_batch_with_lists_and_chat_messages() -> None:
    calls: list[dict[str, Any]] = []

    def length_reward(completions, prompts, completion_ids, solution, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(
            {
                "completions": completions,
                "prompts": prompts,
                "ids": completion_ids,
                "solution": solution,
            }
        )
        return [float(len(c[0]["content"])) for c in completions]

    rubric = Rubric([RewardFunction("len", length_reward, style="trl")])
    pairs = pairs_of(("ab", {"solution": "x"}), ("abcd", {"solution": "y"}))
    prefetched = rubric.prefetch(pairs)
    scores = [rubric.score(t, task, prefetched) for t, task in pairs]
    assert len(calls) == 1
    assert calls[0]["completions"] == [
        [{"role": "assistant", "content": "ab"}],
        [{"role": "assistant", "content": "abcd"}],
    ]
    assert calls[0]["prompts"] == [
        [{"role": "user", "content": "q t0"}],
        [{"role": "user", "content": "q t1"}],
    ]
    assert calls[0]["ids"] == [[2, 3], [2, 3]]
    assert calls[0]["solution"] == ["x", "y"]
    assert [s.total for s in scores] == [2.0, 4.0]


def test_trl_text_style_passes_strings_and_scoring_without_prefetch_calls_a_batch_of_one() -> None:
    seen: list[Any] = []

    def reward(completions, prompts, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((completions, prompts))
        return [1.0 for _ in completions]

    rubric = Rubric([RewardFunction("r", reward, style="trl_text")])
    ((trajectory, task),) = pairs_of(("hello", {}))
    assert rubric.score(trajectory, task).total == 1.0
    assert seen == [(["hello"], ["q t0"])]


def test_none_is_left_out_of_the_sum_and_the_mean_like_trls_nansum() -> None:
    def always_one(completions, **kwargs):  # type: ignore[no-untyped-def]
        return [1.0] * len(completions)

    def only_with_answer(completions, answer, **kwargs):  # type: ignore[no-untyped-def]
        return [None if a is None else 0.5 for a in answer]

    rubric = Rubric(
        [
            RewardFunction("one", always_one, weight=2.0, style="trl"),
            RewardFunction("answer", only_with_answer, weight=3.0, style="trl"),
        ]
    )
    pairs = pairs_of(("a", {"answer": "1"}), ("b", {"answer": None}))
    prefetched = rubric.prefetch(pairs)
    with_answer, without = (rubric.score(t, task, prefetched) for t, task in pairs)
    # 2 * 1.0 + 3 * 0.5 = 3.5; the second row: 2 * 1.0 + (None: nothing) = 2.0, and no error.
    assert with_answer.total == 3.5 and with_answer.rewards == {"one": 1.0, "answer": 0.5}
    assert without.total == 2.0 and without.rewards == {"one": 1.0}
    assert without.ok and without.skipped == ("answer",)


def test_a_row_where_every_function_returns_none_is_unscorable_not_an_error(
    tiny_model_dir: Path,
) -> None:
    """TRL leaves such a completion out of its group's baseline and gives it no advantage: here it
    is not `usable` (so the baseline and the update skip it), warned about, and not counted
    against train.max_reward_error_fraction."""
    from rlvr.envs import SingleTurnEnv
    from rlvr.models import load_policy
    from rlvr.rollout.engine import Scoring
    from rlvr.rollout.hf import HFGenerator

    def maybe(completions, answer, **kwargs):  # type: ignore[no-untyped-def]
        return [None if a is None else 1.0 for a in answer]

    rubric = Rubric([RewardFunction("maybe", maybe, style="trl")])
    policy = load_policy(str(tiny_model_dir))
    generator = HFGenerator(
        policy.model, policy.tokenizer, eos_token_ids=set(), autocast_bf16=False
    )
    tasks = [make_task("known", answer="1"), make_task("unknown", answer=None)]
    with pytest.warns(UserWarning, match="every reward function returned None"):
        groups = rollout_groups(
            tasks,
            SingleTurnEnv,
            generator,
            policy.tokenizer,
            SamplingParams(n=2, temperature=1.0, max_new_tokens=4),
            Scoring(rubric=rubric),
        )
    known, unknown = (g.trajectories for g in groups)
    assert all(t.usable and t.reward == 1.0 for t in known)
    assert all(not t.usable and not t.reward_errors for t in unknown)
    check_error_fraction([*known, *unknown], step=1, limit=0.0)  # no error to count


def test_a_batch_that_raises_or_miscounts_fails_every_row_of_it() -> None:
    def short(completions, **kwargs):  # type: ignore[no-untyped-def]
        return [1.0]

    def nan(completions, **kwargs):  # type: ignore[no-untyped-def]
        return [float("nan")] * len(completions)

    rubric = Rubric(
        [RewardFunction("short", short, style="trl"), RewardFunction("nan", nan, style="trl")]
    )
    pairs = pairs_of(("a", {}), ("b", {}))
    prefetched = rubric.prefetch(pairs)
    for trajectory, task in pairs:
        score = rubric.score(trajectory, task, prefetched)
        assert "returned 1 rewards for 2 completions" in score.errors["short"]
        assert "return None for 'not applicable'" in score.errors["nan"]


def test_style_auto_detects_trls_signature_and_explicit_style_wins(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text(
        "def trl_fn(completions, **kw):\n    return [1.0 for _ in completions]\n"
        "def rlvr_fn(completion, **kw):\n    return 1.0\n"
    )
    rubric = build_rubric(
        [
            RewardSpec(fn="r.py:trl_fn"),
            RewardSpec(fn="r.py:rlvr_fn"),
            RewardSpec(fn="r.py:trl_fn", name="as_text", style="trl_text"),
        ],
        base_dir=tmp_path,
    )
    assert [f.style for f in rubric.functions] == ["trl", "rlvr", "trl_text"]


def test_a_trl_function_needing_a_missing_column_or_trainer_state_is_refused() -> None:
    def needs_solution(completions, solution, **kwargs):  # type: ignore[no-untyped-def]
        return [0.0] * len(completions)

    function = RewardFunction("needs", needs_solution, style="trl")
    with pytest.raises(ConfigError, match=r"'needs' \(TRL style\) needs column\(s\) 'solution'"):
        function.check_fields(frozenset({"answer"}), "t0")

    def needs_state(completions, trainer_state, **kwargs):  # type: ignore[no-untyped-def]
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match="requires trainer_state, which rlvr does not pass"):
        RewardFunction("state", needs_state, style="trl")


def test_the_example_rewards_are_plain_trl_functions() -> None:
    """examples/from_trl_rewards.py is what a TRL user has: called as GRPOTrainer calls it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "from_trl_rewards", EXAMPLES / "from_trl_rewards.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    completions = [
        [{"role": "assistant", "content": "12"}],
        [{"role": "assistant", "content": "x"}],
    ]
    assert module.digit_reward(completions=completions, prompts=[[], []]) == [1.0, 0.0]
    assert module.correct_answer(completions=completions, answer=["12", None]) == [1.0, None]


@pytest.mark.precision
def test_the_coming_from_trl_config_trains_on_the_tiny_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """docs/coming_from_trl.md's rlvr side: its YAML is examples/from_trl.yaml, which runs."""
    from rlvr.train.loop import train

    doc = (ROOT / "docs" / "coming_from_trl.md").read_text()
    yaml_blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    assert (EXAMPLES / "from_trl.yaml").read_text() in yaml_blocks
    for name in ("from_trl.yaml", "from_trl_rewards.py", "from_trl_prompts.jsonl"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    cfg = load_config(
        tmp_path / "from_trl.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "train.steps=2",
            "tracking.progress=false",
        ],
    )
    summary = train(cfg, config_dir=tmp_path)
    steps = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").open()]
    trained = [m for m in steps if "reward" in m and "step" in m]
    assert trained and all("rewards/digit_reward/mean" in m for m in trained)
    assert all(m["rewards/digit_reward/errors"] == 0 for m in trained)
    assert all(m["rewards/correct_answer/errors"] == 0 for m in trained)


def test_the_docs_show_the_example_files_as_they_are() -> None:
    doc = (ROOT / "docs" / "coming_from_trl.md").read_text()
    python_blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert (EXAMPLES / "from_trl_rewards.py").read_text() in python_blocks
    assert (EXAMPLES / "from_trl_grpo.py").read_text() in python_blocks


def test_the_trl_side_runs_where_trl_is_installed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The GRPOTrainer script of the docs, one step on the tiny model: the same reward functions
    are logged under the same names rlvr logs them."""
    import os
    import subprocess
    import sys

    pytest.importorskip("trl")
    for name in ("from_trl_grpo.py", "from_trl_rewards.py", "from_trl_prompts.jsonl"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    command = [
        sys.executable,
        "from_trl_grpo.py",
        "--model",
        str(tiny_model_dir),
        "--max-steps",
        "1",
    ]
    command += ["--output-dir", str(tmp_path / "out")]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rewards/digit_reward/mean" in done.stdout + done.stderr


def test_eval_accuracy_on_a_trl_metric_leaves_out_the_samples_it_does_not_apply_to(
    tiny_model_dir: Path,
) -> None:
    """Two held-out tasks, the metric pays 1.0 on one and None on the other: accuracy 1.0 (TRL's
    nanmean), not 0.5."""
    from rlvr.evaluate import evaluate
    from rlvr.models import load_policy
    from rlvr.rollout.engine import Scoring
    from rlvr.rollout.hf import HFGenerator

    def solved(completions, answer, **kwargs):  # type: ignore[no-untyped-def]
        return [None if a is None else 1.0 for a in answer]

    policy = load_policy(str(tiny_model_dir))
    generator = HFGenerator(
        policy.model, policy.tokenizer, eos_token_ids=set(), autocast_bf16=False
    )
    tasks = [make_task("known", answer="1"), make_task("unknown", answer=None)]
    with pytest.warns(UserWarning, match="every reward function returned None"):
        ev = evaluate(
            tasks,
            None,
            generator,
            policy.tokenizer,
            Scoring(rubric=Rubric([RewardFunction("solved", solved, style="trl")])),
            metric="solved",
            max_new_tokens=3,
        )
    assert ev["eval/accuracy"] == 1.0 and ev["eval/errors"] == 0.0
