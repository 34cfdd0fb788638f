"""The hang watchdog (rlvr.observe.watchdog): a phase past its deadline dumps every thread's stack,
says which phase hung, and ends the run with code 124 instead of hanging forever.

The end-to-end tests run `rlvr train` in a subprocess with a deliberately hanging env, reward
function, and a reward that holds the GIL (caught by faulthandler's C-level backstop)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlvr.observe import watchdog as wd
from rlvr.observe.watchdog import EXIT_CODE, STACKS_FILE, Watchdog, watch


def stuck_in_the_verifier(release: threading.Event) -> None:
    release.wait(30)


def test_a_call_past_its_deadline_dumps_every_stack_and_exits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exits: list[int] = []
    dog = Watchdog({"reward": 0.3}, tmp_path, exit=exits.append).start()
    release = threading.Event()

    def score() -> None:
        with watch("reward", "judge"):
            stuck_in_the_verifier(release)

    scorer = threading.Thread(target=score, name="scorer")
    try:
        dog.step = 7
        started = time.monotonic()
        scorer.start()
        while not exits and time.monotonic() - started < 10:
            time.sleep(0.05)
        waited = time.monotonic() - started
    finally:
        release.set()
        scorer.join()
        dog.close()
    assert exits == [EXIT_CODE]
    assert 0.3 <= waited < 2.0
    stacks = (tmp_path / STACKS_FILE).read_text()
    first_thread = stacks.split("Thread ", 2)[1]  # the hung thread is listed first
    assert "'scorer'" in first_thread and "stuck_in_the_verifier" in first_thread
    assert "faulthandler" in stacks
    err = capsys.readouterr().err
    assert "phase 'reward' (judge) hung for" in err and "at step 7" in err
    assert "stuck_in_the_verifier" in err and "watchdog.reward_s" in err
    assert "no checkpoint yet" in err and f"code {EXIT_CODE}" in err
    event = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert event["event"] == "watchdog/hang" and event["phase"] == "reward" and event["step"] == 7


def test_the_message_names_the_checkpoint_the_trainer_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The watchdog does not import the trainer: the loop passes its checkpoint lookup, and a lookup
    that fails while the run is hung still lets the stacks and the exit through."""
    saved = tmp_path / "checkpoints" / "step-4"
    for lookup, said in (
        (lambda: saved, f"the last checkpoint is {saved}"),
        (_raises, "no checkpoint yet"),
    ):
        exits: list[int] = []
        dog = Watchdog({"update": 0.2}, tmp_path, last_checkpoint=lookup, exit=exits.append).start()
        try:
            with watch("update"):
                deadline = time.monotonic() + 10
                while not exits and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            dog.close()
        assert exits == [EXIT_CODE]
        assert said in capsys.readouterr().err


def _raises() -> Path:
    raise RuntimeError("no checkpoints/ folder")


def test_calls_within_their_deadline_and_unwatched_phases_never_fire(tmp_path: Path) -> None:
    exits: list[int] = []
    dog = Watchdog({"reward": 0.4, "env_step": 0}, tmp_path, exit=exits.append).start()
    try:
        for _ in range(8):  # 1.2 s of watched calls, each well inside its deadline
            with watch("reward"):
                time.sleep(0.15)
        with watch("env_step"):  # deadline 0: not watched
            time.sleep(0.6)
        time.sleep(0.3)
    finally:
        dog.close()
    assert exits == []
    assert not (tmp_path / STACKS_FILE).exists()  # the placeholder goes at a clean close
    assert wd._current is None


def test_watch_without_a_watchdog_is_a_no_op() -> None:
    assert wd._current is None
    with watch("generation"):
        pass


# ------------------------------------------------------------------------------------- end to end
HANG_ENV = """
import time
from rlvr.envs import Env, EnvFamily, EnvReset, EnvStep
from rlvr.records import Task

def wait_for_the_simulator(marker):
    open(marker, "w").write(str(time.time()))
    time.sleep(3600)

class HangEnv(Env):
    def __init__(self, task):
        self.task = task
    def reset(self):
        return EnvReset([dict(m) for m in self.task.messages])
    def step(self, assistant_text):
        wait_for_the_simulator(MARKER)
        return EnvStep(rewards={"ok": 1.0}, done=True)

class HangFamily(EnvFamily):
    name = "hang"
    description = "Never answers."
    success_metric = "ok"
    def generate(self, seed):
        return Task(id=f"hang:{seed}", messages=({"role": "user", "content": f"Say {seed}."},))
    def make(self, task):
        return HangEnv(task)
"""

HANG_REWARDS = """
import re, time

def wait_for_the_judge(marker):
    open(marker, "w").write(str(time.time()))
    time.sleep(3600)

def stuck_reward(completion, **kwargs):
    wait_for_the_judge(MARKER)
    return 0.0

def catastrophic_regex(completion, **kwargs):
    open(MARKER, "w").write(str(time.time()))
    # Exponential backtracking inside `re`, which never releases the GIL: no Python thread runs.
    return float(bool(re.match(r"(a+)+$", "a" * 40 + "b")))
"""


def _run_hanging(
    tmp_path: Path, tiny_model_dir: Path, config: str, files: dict[str, str], *sets: str
) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    """`rlvr train` on `config` in a subprocess; returns (result, seconds from the hang's start to
    the process's end, run dir)."""
    marker = tmp_path / "hang_started"
    for name, text in files.items():
        (tmp_path / name).write_text(text.replace("MARKER", repr(str(marker))))
    (tmp_path / "run.yaml").write_text(config)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "rlvr.cli", "train", str(tmp_path / "run.yaml"),
        "--output-dir", str(run_dir), "--set", f"model.name={tiny_model_dir}", *sets,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    ended = time.time()
    assert marker.exists(), done.stderr[-3000:]
    return done, ended - float(marker.read_text()), run_dir


BASE = """
model: {bf16: "off"}
sampling: {group_size: 2, prompts_per_step: 2, max_new_tokens: 4, temperature: 1.0}
train: {steps: 2, micro_batch_size: 4}
eval: {at_start: false, at_end: false, n: 2}
checkpoint: {save_final: false}
tracking: {trackio: false, progress: false}
"""


def test_a_hanging_env_step_ends_the_run_with_its_stack(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = "task:\n  source: env\n  env: {name: hang_env.py:HangFamily, num_train: 20, num_heldout: 2}\n"
    done, hung_for, run_dir = _run_hanging(
        tmp_path, tiny_model_dir, config + BASE, {"hang_env.py": HANG_ENV},
        "--set", "watchdog.env_step_s=2",
    )  # fmt: skip
    assert done.returncode == EXIT_CODE, done.stderr[-3000:]
    assert 2.0 <= hung_for < 6.0
    assert "phase 'env_step' (HangEnv.step) hung for" in done.stderr
    assert "wait_for_the_simulator" in done.stderr and "at step 1" in done.stderr
    assert "wait_for_the_simulator" in (run_dir / STACKS_FILE).read_text()


def test_a_hanging_reward_ends_the_run_with_its_stack(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = "rewards:\n  - {fn: hang_rewards.py:stuck_reward, name: stuck}\n"
    done, hung_for, run_dir = _run_hanging(
        tmp_path, tiny_model_dir, config + BASE, {"hang_rewards.py": HANG_REWARDS},
        "--set", "watchdog.reward_s=2",
    )  # fmt: skip
    assert done.returncode == EXIT_CODE, done.stderr[-3000:]
    assert 2.0 <= hung_for < 6.0
    assert "phase 'reward' (stuck) hung for" in done.stderr
    assert "wait_for_the_judge" in (run_dir / STACKS_FILE).read_text()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["phase"] for e in events if e.get("event") == "watchdog/hang"] == ["reward"]


def test_a_reward_holding_the_gil_is_caught_by_the_backstop(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The watchdog thread cannot run while `re` holds the GIL; faulthandler's C timer, armed at
    deadline + backstop_grace_s when the call started, dumps the stacks and exits (code 1)."""
    config = "rewards:\n  - {fn: hang_rewards.py:catastrophic_regex, name: regex}\n"
    done, hung_for, run_dir = _run_hanging(
        tmp_path, tiny_model_dir, config + BASE, {"hang_rewards.py": HANG_REWARDS},
        "--set", "watchdog.reward_s=2", "--set", "watchdog.backstop_grace_s=2",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert 4.0 <= hung_for < 8.0
    stacks = (run_dir / STACKS_FILE).read_text()
    assert "Timeout" in stacks and "catastrophic_regex" in stacks
