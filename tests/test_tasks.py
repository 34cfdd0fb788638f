"""Task sources (procedural arithmetic, user datasets) and the resumable TaskSampler (no model)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import ArithmeticConfig, DatasetConfig, TaskConfig
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.tasks import TaskSampler, arithmetic_tasks, dataset_tasks, load_tasks


def ids(tasks: list[Task]) -> list[str]:
    return [t.id for t in tasks]


def user_text(task: Task) -> str:
    return next(m["content"] for m in task.messages if m["role"] == "user")


# --- arithmetic ---
def test_arithmetic_split_is_disjoint_and_covers_every_two_digit_problem() -> None:
    splits = arithmetic_tasks(ArithmeticConfig())
    train, heldout = set(ids(splits.train)), set(ids(splits.heldout))
    assert len(train) == len(splits.train)  # no duplicates within a split
    assert len(heldout) == len(splits.heldout)
    assert not train & heldout
    expected = {f"arith:{a}+{b}" for a in range(10, 100) for b in range(10, 100)}
    assert len(expected) == 8100
    assert train | heldout == expected
    # heldout_fraction 0.1 of 8100: the hash split lands near 810.
    assert 700 < len(heldout) < 920


def test_arithmetic_split_does_not_depend_on_any_seed() -> None:
    random.seed(1)
    first = arithmetic_tasks(ArithmeticConfig())
    random.seed(2)
    second = arithmetic_tasks(ArithmeticConfig())
    assert ids(first.train) == ids(second.train)
    assert ids(first.heldout) == ids(second.heldout)
    # The run's seed lives in train.seed; the task config never sees it.
    a = load_tasks(TaskConfig())
    b = load_tasks(TaskConfig())
    assert ids(a.heldout) == ids(first.heldout)
    assert ids(b.train) == ids(first.train)


def test_arithmetic_split_is_the_same_in_another_process_with_another_hash_seed() -> None:
    """Python's str hash is salted per process; the split must not be."""
    code = (
        "import hashlib; from rlvr.config import ArithmeticConfig; from rlvr.tasks import "
        "arithmetic_tasks; s = arithmetic_tasks(ArithmeticConfig()); "
        "print(hashlib.sha256('|'.join(t.id for t in s.heldout).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    here = arithmetic_tasks(ArithmeticConfig())
    digest = hashlib.sha256("|".join(ids(here.heldout)).encode()).hexdigest()
    assert out.stdout.strip() == digest


@pytest.mark.parametrize(
    ("op", "fn"),
    [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)],
)
def test_arithmetic_answers_are_right(op: str, fn: Any) -> None:
    splits = arithmetic_tasks(ArithmeticConfig(digits=1, operations=[op]))
    tasks = splits.train + splits.heldout
    assert len(tasks) == 100
    for task in tasks:
        a, b = task.id.removeprefix("arith:").split(op)
        assert task.fields["answer"] == fn(int(a), int(b))
        assert user_text(task) == f"What is {a} {op} {b}?"


def test_arithmetic_mixed_operations_cover_each_operation() -> None:
    splits = arithmetic_tasks(ArithmeticConfig(digits=1, operations=["+", "-", "*"]))
    tasks = {t.id: t for t in splits.train + splits.heldout}
    assert len(tasks) == 300
    assert tasks["arith:7+8"].fields["answer"] == 15
    assert tasks["arith:3-9"].fields["answer"] == -6
    assert tasks["arith:7*8"].fields["answer"] == 56


def test_arithmetic_prompt_template_and_system_prompt() -> None:
    cfg = ArithmeticConfig(digits=1, prompt="Compute {a}{op}{b}. Answer with a number.")
    splits = arithmetic_tasks(cfg, system_prompt="You are a calculator.")
    task = next(t for t in splits.train + splits.heldout if t.id == "arith:4+5")
    assert task.messages == (
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "Compute 4+5. Answer with a number."},
    )
    plain = arithmetic_tasks(cfg)
    assert all(len(t.messages) == 1 and t.messages[0]["role"] == "user" for t in plain.train)


def test_arithmetic_heldout_order_is_stable() -> None:
    first = arithmetic_tasks(ArithmeticConfig())
    second = arithmetic_tasks(ArithmeticConfig(), system_prompt="anything")
    assert ids(first.heldout) == ids(second.heldout)
    # The order is a fixed hash order, not enumeration order, so "the first n" spans the range.
    assert ids(first.heldout) != sorted(ids(first.heldout))
    firsts = {t.id.removeprefix("arith:").split("+")[0] for t in first.heldout[:50]}
    assert len(firsts) > 10
    # Pinned: a change to the hash would silently change every held-out number ever reported.
    assert len(first.heldout) == 798
    assert ids(first.heldout[:5]) == [
        "arith:21+49",
        "arith:60+47",
        "arith:64+33",
        "arith:13+68",
        "arith:58+59",
    ]


# --- sampler ---
def make_tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", messages=({"role": "user", "content": str(i)},)) for i in range(n)]


def test_sampler_is_deterministic_for_a_seed() -> None:
    tasks = make_tasks(10)
    a, b, c = TaskSampler(tasks, seed=3), TaskSampler(tasks, seed=3), TaskSampler(tasks, seed=4)
    seq_a = [ids(a.next_batch(3)) for _ in range(8)]
    seq_b = [ids(b.next_batch(3)) for _ in range(8)]
    seq_c = [ids(c.next_batch(3)) for _ in range(8)]
    assert seq_a == seq_b
    assert seq_a != seq_c


def test_sampler_walks_shuffled_epochs_without_repeats() -> None:
    tasks = make_tasks(7)
    sampler = TaskSampler(tasks, seed=0)
    drawn = ids(sampler.next_batch(21))
    for epoch in range(3):
        assert sorted(drawn[epoch * 7 : (epoch + 1) * 7]) == sorted(ids(tasks))
    assert drawn[:7] != drawn[7:14]  # a new shuffle each epoch
    assert sampler.state_dict() == {"epoch": 2, "index": 7}


def test_sampler_rejects_no_tasks() -> None:
    with pytest.raises(ConfigError, match="no training tasks"):
        TaskSampler([], seed=0)


@pytest.mark.parametrize(
    "drawn_before",
    [4, 7, 10, 14],  # mid-epoch, exactly at the epoch's end, in epoch 1, at the end of epoch 1
)
def test_sampler_state_round_trip_reproduces_the_next_batches(drawn_before: int) -> None:
    tasks = make_tasks(7)
    uninterrupted = TaskSampler(tasks, seed=11)
    interrupted = TaskSampler(tasks, seed=11)
    uninterrupted.next_batch(drawn_before)
    interrupted.next_batch(drawn_before)
    state = json.loads(json.dumps(interrupted.state_dict()))  # as a checkpoint stores it

    restored = TaskSampler(tasks, seed=11)
    restored.next_batch(5)  # its own position must not matter
    restored.load_state_dict(state)
    expected = [ids(uninterrupted.next_batch(3)) for _ in range(6)]  # crosses epoch boundaries
    assert [ids(restored.next_batch(3)) for _ in range(6)] == expected
    assert restored.state_dict() == uninterrupted.state_dict()


def test_sampler_batch_larger_than_the_task_list() -> None:
    tasks = make_tasks(3)
    whole = TaskSampler(tasks, seed=5)
    batch = ids(whole.next_batch(8))
    stepwise = TaskSampler(tasks, seed=5)
    assert batch == [stepwise.next_batch(1)[0].id for _ in range(8)]


# --- datasets ---
def _use_tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    return datasets


def qa_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "question": f"What is {i} squared?",
            "solution": str(i * i),
            "level": i % 3,
            "persona": f"tutor {i}",
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_config(path: Path | str, **kw: Any) -> DatasetConfig:
    return DatasetConfig(path=str(path), prompt_column="question", answer_column="solution", **kw)


def check_qa_split(splits: Any, n: int) -> None:
    train, heldout = ids(splits.train), ids(splits.heldout)
    assert train and heldout
    assert not set(train) & set(heldout)
    assert len(train) + len(heldout) == n
    for task in splits.train + splits.heldout:
        i = int(user_text(task).split()[2])
        assert task.fields["answer"] == str(i * i)


def test_dataset_from_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    path = write_jsonl(tmp_path / "squares.jsonl", qa_rows(60))
    splits = dataset_tasks(qa_config(path), system_prompt="Be brief.")
    check_qa_split(splits, 60)
    task = splits.train[0]
    assert task.messages[0] == {"role": "system", "content": "Be brief."}
    assert task.id.startswith("squares:")
    assert set(task.fields) == {"answer"}
    # Stable: a second load splits the same way.
    again = dataset_tasks(qa_config(path), system_prompt="Be brief.")
    assert ids(again.heldout) == ids(splits.heldout)


def test_dataset_from_parquet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = _use_tmp_cache(tmp_path, monkeypatch)
    path = tmp_path / "squares.parquet"
    datasets.Dataset.from_list(qa_rows(60)).to_parquet(str(path))
    splits = dataset_tasks(qa_config(path))
    check_qa_split(splits, 60)
    jsonl = dataset_tasks(qa_config(write_jsonl(tmp_path / "squares.jsonl", qa_rows(60))))
    assert ids(splits.heldout) == ids(jsonl.heldout)  # same file stem, same ids, same split


def test_dataset_from_in_memory_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = _use_tmp_cache(tmp_path, monkeypatch)
    rows = datasets.Dataset.from_list(qa_rows(60))
    splits = dataset_tasks(qa_config("in-memory"), rows=rows)
    check_qa_split(splits, 60)
    assert all(t.id.startswith("in-memory:") for t in splits.train)


def test_dataset_column_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    path = write_jsonl(tmp_path / "squares.jsonl", qa_rows(40))
    cfg = qa_config(path, extra_columns=["level"], system_column="persona")
    splits = dataset_tasks(cfg, system_prompt="ignored: the column wins")
    for task in splits.train + splits.heldout:
        i = int(user_text(task).split()[2])
        assert task.fields == {"level": i % 3, "answer": str(i * i)}
        assert task.messages == (
            {"role": "system", "content": f"tutor {i}"},
            {"role": "user", "content": f"What is {i} squared?"},
        )


def test_dataset_without_answer_column(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    path = write_jsonl(tmp_path / "squares.jsonl", qa_rows(40))
    cfg = DatasetConfig(path=str(path), prompt_column="question", answer_column=None)
    splits = dataset_tasks(cfg)
    assert all("answer" not in t.fields for t in splits.train + splits.heldout)


def test_dataset_id_column_is_used_as_task_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    rows = [{"id": f"q-{i}", **r} for i, r in enumerate(qa_rows(40))]
    splits = dataset_tasks(qa_config(write_jsonl(tmp_path / "d.jsonl", rows)))
    assert set(ids(splits.train + splits.heldout)) == {f"q-{i}" for i in range(40)}


def test_dataset_prompt_column_with_chat_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = _use_tmp_cache(tmp_path, monkeypatch)
    rows = [
        {
            "chat": [
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": f"Count to {i}."},
            ],
            "answer": str(i),
        }
        for i in range(40)
    ]
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    cfg = DatasetConfig(path=str(path), prompt_column="chat")
    for source in (path, write_jsonl(tmp_path / "chat.jsonl", rows)):
        splits = dataset_tasks(cfg.model_copy(update={"path": str(source)}), system_prompt="unused")
        for task in splits.train + splits.heldout:
            i = task.fields["answer"]
            assert task.messages == (
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": f"Count to {i}."},
            )


def test_dataset_separate_heldout_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    rows = qa_rows(30)
    train_path = write_jsonl(tmp_path / "train.jsonl", rows[:20])
    test_path = write_jsonl(tmp_path / "test.jsonl", rows[20:])
    splits = dataset_tasks(qa_config(train_path, heldout_path=str(test_path)))
    assert len(splits.train) == 20  # nothing carved off: the held-out set is the other file
    assert [user_text(t) for t in splits.heldout] == [r["question"] for r in rows[20:]]
    assert [t.fields["answer"] for t in splits.heldout] == [r["solution"] for r in rows[20:]]
    assert not set(ids(splits.train)) & set(ids(splits.heldout))


def test_dataset_too_small_to_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    path = write_jsonl(tmp_path / "one.jsonl", qa_rows(1))
    with pytest.raises(ConfigError, match="too small"):
        dataset_tasks(qa_config(path))


@pytest.mark.parametrize(
    "field", ["prompt_column", "answer_column", "system_column", "extra_columns"]
)
def test_dataset_missing_column_names_it_and_lists_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    path = write_jsonl(tmp_path / "squares.jsonl", qa_rows(20))
    values: dict[str, Any] = {
        "prompt_column": "problem",
        "answer_column": "problem",
        "system_column": "problem",
        "extra_columns": ["problem"],
    }
    base = {"prompt_column": "question", "answer_column": "solution"}
    cfg = DatasetConfig(path=str(path), **{**base, field: values[field]})
    with pytest.raises(ConfigError) as err:
        dataset_tasks(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert "'problem'" in message
    for column in ("question", "solution", "level", "persona"):
        assert column in message
    assert str(path) in message


def test_dataset_missing_column_in_memory_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = _use_tmp_cache(tmp_path, monkeypatch)
    rows = datasets.Dataset.from_list(qa_rows(5))
    with pytest.raises(ConfigError, match=r"no column 'answer'.*question, solution"):
        dataset_tasks(DatasetConfig(path="mem", prompt_column="question"), rows=rows)


def test_dataset_missing_file_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError) as err:
        dataset_tasks(qa_config(missing))
    assert str(missing) in str(err.value)
    assert "does not exist" in str(err.value)
    assert "\n" not in str(err.value)


def test_dataset_missing_heldout_file_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    path = write_jsonl(tmp_path / "train.jsonl", qa_rows(10))
    missing = tmp_path / "test.parquet"
    with pytest.raises(ConfigError, match=r"test\.parquet"):
        dataset_tasks(qa_config(path, heldout_path=str(missing)))


def test_load_tasks_dispatches_on_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_tmp_cache(tmp_path, monkeypatch)
    path = write_jsonl(tmp_path / "squares.jsonl", qa_rows(30))
    cfg = TaskConfig(source="dataset", dataset=qa_config(path), system_prompt="Sys.")
    splits = load_tasks(cfg)
    check_qa_split(splits, 30)
    assert splits.train[0].messages[0] == {"role": "system", "content": "Sys."}
