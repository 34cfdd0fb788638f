"""Where tasks come from: a procedural arithmetic family and user datasets (JSONL, parquet, HF).

Every source yields a train list and a held-out list that share no task, plus `TaskSampler`, which
walks the train list in seeded shuffled epochs and can save and restore its position exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvr.config import ArithmeticConfig, DatasetConfig, TaskConfig
from rlvr.errors import ConfigError
from rlvr.records import Task


@dataclass(frozen=True)
class TaskSplits:
    train: list[Task]
    heldout: list[Task]


def _messages(prompt: str, system_prompt: str | None) -> tuple[dict[str, str], ...]:
    if system_prompt:
        return ({"role": "system", "content": system_prompt}, {"role": "user", "content": prompt})
    return ({"role": "user", "content": prompt},)


def _stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by `key` alone (not by Python's salted hash), for stable splits."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ---------------------------------------------------------------------------------------------- arithmetic
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_tasks(cfg: ArithmeticConfig, system_prompt: str | None = None) -> TaskSplits:
    """Every (a, op, b) with `digits`-digit operands; a fixed hash of the problem picks the held-out ones.

    The split depends on the problem alone, never on the seed, so no seed can leak held-out problems
    into training. 2-digit addition: 8,100 problems, about 810 held out.
    """
    low, high = 10 ** (cfg.digits - 1) if cfg.digits > 1 else 0, 10**cfg.digits - 1
    if (high - low + 1) ** 2 * len(cfg.operations) > 2_000_000:
        raise ConfigError(
            f"task.arithmetic.digits={cfg.digits} makes too many problems to enumerate"
        )
    train: list[Task] = []
    heldout: list[Task] = []
    for op in cfg.operations:
        for a in range(low, high + 1):
            for b in range(low, high + 1):
                key = f"{a}{op}{b}"
                task = Task(
                    id=f"arith:{key}",
                    messages=_messages(cfg.prompt.format(a=a, b=b, op=op), system_prompt),
                    fields={"answer": _OPS[op](a, b)},
                )
                (heldout if _stable_fraction(key) < cfg.heldout_fraction else train).append(task)
    # Held-out order is fixed by the hash too, so "the first n held-out tasks" is the same set everywhere.
    heldout.sort(key=lambda t: _stable_fraction("order:" + t.id))
    return TaskSplits(train=train, heldout=heldout)


# ---------------------------------------------------------------------------------------------- datasets
def read_json_rows(path: Path, what: str = "data file") -> list[dict[str, Any]]:
    """The rows of a .jsonl file (one JSON object a line) or a .json file (a list of objects, or
    JSON lines). Read here rather than by `datasets`, whose errors for an empty file (StopIteration)
    or a bad line (DatasetGenerationError) name neither the file nor the line."""
    if not path.is_file():
        raise ConfigError(f"{what} '{path}' does not exist")
    text = path.read_text()
    rows: list[Any] = []
    whole: Any = None
    if path.suffix.lower() == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as err:
            if text.lstrip().startswith("["):
                raise ConfigError(f"{path} line {err.lineno}: invalid JSON ({err.msg})") from None
            # else: maybe JSON lines in a .json file, read below line by line
        if whole is not None and not isinstance(whole, list):
            raise ConfigError(f"{path}: a .json file must hold a list of rows (or JSON lines)")
    if isinstance(whole, list):
        rows = whole
    else:
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path} line {line_no}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{path} line {line_no}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(
                f"{path} row {i + 1}: expected a JSON object, got {type(row).__name__}"
            )
    if not rows:
        raise ConfigError(f"{what} '{path}' has no rows")
    return rows


def _load_rows(path: str, split: str) -> Any:
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_json_rows(Path(path), "dataset file")
    import datasets

    builders = {".parquet": "parquet", ".csv": "csv"}
    if suffix in builders:
        if not Path(path).is_file():
            raise ConfigError(f"dataset file '{path}' does not exist")
        loaders = [lambda: datasets.load_dataset(builders[suffix], data_files=path, split="train")]
    elif Path(path).is_dir():
        loaders = [lambda: datasets.load_from_disk(path)]
    else:
        loaders = [lambda: datasets.load_dataset(path, split=split)]
    try:
        rows = loaders[0]()
    except Exception as err:  # datasets raises many types; the user needs one line either way
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"could not load dataset '{path}' (split {split}): {first}") from err
    if len(rows) == 0:
        raise ConfigError(f"dataset '{path}' has no rows")
    return rows


def check_messages(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    """A prompt given as chat messages: a non-empty list of {"role": str, "content": str, ...}."""
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of chat messages")
    for j, message in enumerate(value, start=1):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ConfigError(
                f"{where}: message {j} must be an object with string 'role' and 'content' "
                f"(got {str(message)[:80]})"
            )
    return tuple(dict(m) for m in value)


def tasks_from_rows(
    rows: Any, cfg: DatasetConfig, system_prompt: str | None, source: str, id_prefix: str = ""
) -> list[Task]:
    """Map dataset rows to Tasks by the configured column names; a missing column is a config error."""
    columns = list(getattr(rows, "column_names", None) or (rows[0].keys() if len(rows) else []))
    wanted = [cfg.prompt_column, cfg.answer_column, cfg.system_column, *cfg.extra_columns]
    for col in wanted:
        if col is not None and col not in columns:
            raise ConfigError(
                f"dataset '{source}' has no column '{col}' (columns: {', '.join(map(str, columns))}); "
                f"set task.dataset.prompt_column / answer_column / extra_columns"
            )
    tasks = []
    for i, row in enumerate(rows):
        where = f"dataset '{source}' row {i + 1}"
        absent = [c for c in wanted if c is not None and c not in row]
        if absent:  # rows of a JSON-lines file need not share their keys
            raise ConfigError(f"{where} has no '{absent[0]}' field")
        prompt = row[cfg.prompt_column]
        if isinstance(prompt, list | tuple):  # already chat messages
            messages = check_messages(prompt, f"{where}, '{cfg.prompt_column}'")
        elif isinstance(prompt, Mapping) or prompt is None:
            raise ConfigError(
                f"{where}: '{cfg.prompt_column}' must be a string or a list of chat messages, "
                f"not {'null' if prompt is None else 'an object'}"
            )
        else:
            system = row[cfg.system_column] if cfg.system_column else system_prompt
            messages = _messages(str(prompt), system)
        fields = {c: row[c] for c in cfg.extra_columns}
        if cfg.answer_column:
            fields["answer"] = row[cfg.answer_column]
        task_id = id_prefix + str(row.get("id", f"{Path(source).stem}:{i}"))
        tasks.append(Task(id=task_id, messages=messages, fields=fields))
    return tasks


def dataset_tasks(
    cfg: DatasetConfig, system_prompt: str | None = None, rows: Any = None
) -> TaskSplits:
    """Tasks from a file, a saved dataset dir, a hub dataset, or (API) an in-memory `datasets.Dataset`."""
    source = cfg.path
    rows = _load_rows(cfg.path, cfg.split) if rows is None else rows
    tasks = tasks_from_rows(rows, cfg, system_prompt, source)
    if cfg.heldout_path:
        heldout_rows = _load_rows(cfg.heldout_path, cfg.split)
        heldout = tasks_from_rows(
            heldout_rows, cfg, system_prompt, cfg.heldout_path, id_prefix="heldout:"
        )
        return TaskSplits(train=tasks, heldout=heldout)
    train = [t for t in tasks if _stable_fraction(t.id) >= cfg.heldout_fraction]
    heldout = [t for t in tasks if _stable_fraction(t.id) < cfg.heldout_fraction]
    if not train or not heldout:
        raise ConfigError(
            f"dataset '{source}' ({len(tasks)} rows) is too small to split off a held-out set"
        )
    return TaskSplits(train=train, heldout=heldout)


def load_tasks(cfg: TaskConfig) -> TaskSplits:
    if cfg.source == "arithmetic":
        return arithmetic_tasks(cfg.arithmetic, cfg.system_prompt)
    if cfg.source == "env":
        from rlvr.envs import get_env_family

        assert cfg.env is not None  # enforced by TaskConfig's validator
        family = get_env_family(cfg.env.name, cfg.env.options)
        train, heldout = family.make_splits(
            cfg.env.num_train, cfg.env.num_heldout, cfg.env.heldout_fraction
        )
        return TaskSplits(train=train, heldout=heldout)
    assert cfg.dataset is not None  # enforced by TaskConfig's validator
    return dataset_tasks(cfg.dataset, cfg.system_prompt)


# ---------------------------------------------------------------------------------------------- sampler
class TaskSampler:
    """Draws batches from the train tasks in shuffled epochs; its state is two integers.

    The order of epoch e is a shuffle seeded by (seed, e), so restoring (epoch, index) reproduces
    exactly the tasks an uninterrupted run would have drawn.
    """

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        if not tasks:
            raise ConfigError("no training tasks")
        self.tasks = list(tasks)
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Task]:
        batch = []
        for _ in range(n):
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._shuffled(self.epoch)
            batch.append(self.tasks[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._shuffled(self.epoch)
