"""No run lost, none mixed: run files are data (never unpickled code), a run directory is never
reused by accident, an interrupted run saves a checkpoint and resumes exactly, and the DPO
reference cache is only reused for the model and loss it was computed for."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.config import RunConfig, load_config
from rlvr.errors import ConfigError
from rlvr.observe.metrics import WALL_CLOCK_METRICS
from rlvr.observe.tracking import read_metrics
from rlvr.train.loop import train

SRC = Path(__file__).resolve().parent.parent / "src"
RLVR = Path(sys.executable).parent / "rlvr"


def tiny_cfg(config_dir: Path, model_dir: Path, out: Path, *overrides: str) -> RunConfig:
    return load_config(
        config_dir / "tiny.yaml",
        [
            f"model.name={model_dir}",
            f"output_dir={out}",
            "tracking.progress=false",
            "model.bf16='off'",
            *overrides,
        ],
    )


def by_step(run: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl merged per step, without the wall-clock metrics and without event rows."""
    rows: dict[int, dict[str, Any]] = {}
    for m in read_metrics(run):
        if "event" in m:
            continue
        rows.setdefault(m["step"], {}).update(
            {k: v for k, v in m.items() if k not in WALL_CLOCK_METRICS}
        )
    return rows


# ---------------------------------------------------------------------------------------------- data
def test_no_source_file_unpickles_code() -> None:
    """`torch.load(..., weights_only=False)` runs whatever a pickle says; no run file is read so."""
    offenders = [
        f"{path.relative_to(SRC)}:{i}"
        for path in SRC.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"weights_only\s*=\s*False", line) or re.search(r"pickle\.loads?\(", line)
    ]
    assert offenders == []


def test_checkpoint_files_are_plain_data_and_resume_loads_them(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = tiny_cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "run",
        "train.steps=2",
        "checkpoint.every=1",
        "eval.at_start=false",
        "eval.at_end=false",
    )
    train(cfg, config_dir=tiny_config_dir)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.load(checkpoint / name, weights_only=True)  # raises on anything but plain data
    rng = torch.load(checkpoint / "rng.pt", weights_only=True)
    assert rng["torch"].dtype == torch.uint8
    json_state = json.loads((checkpoint / "rng.json").read_text())
    assert set(json_state) == {"python", "numpy"}

    # A planted pickle payload is refused with a one-line error, never executed.
    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"torch": Boom()}, checkpoint / "rng.pt")
    with pytest.raises(ConfigError, match=r"rng\.pt holds more than tensors"):
        train(cfg, resume=True, config_dir=tiny_config_dir)
    assert not (tmp_path / "pwned").exists()

    # A checkpoint from before rng.json (its RNG state pickled with numpy) is named as such.
    from rlvr.train.checkpoint import load_training_state

    (checkpoint / "rng.json").unlink()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    with pytest.raises(ConfigError, match="written by an older rlvr"):
        load_training_state(checkpoint, opt, sched)


def test_dpo_reference_cache_is_keyed_on_model_and_averaging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlvr.models import load_policy, make_tiny_model_dir
    from rlvr.offline import dpo as dpo_module
    from rlvr.offline.data import pair_examples

    rows = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(4)]
    calls: list[str] = []
    original = dpo_module.pair_logps

    def counting(model: Any, pairs: list[Any], **kw: Any) -> Any:
        calls.append(f"average={kw['average']}")
        return original(model, pairs, **kw)

    monkeypatch.setattr(dpo_module, "pair_logps", counting)
    cache = tmp_path / dpo_module.REFERENCE_FILE

    def reference(model_dir: Path, average: bool) -> dict[str, Any]:
        policy = load_policy(str(model_dir))
        pairs = pair_examples(policy.tokenizer, rows, source="mem", max_length=64, truncate=False)
        return dpo_module.reference_logps(
            cache,
            policy,
            {"train": pairs},
            model_name=str(model_dir),
            pad_id=int(policy.tokenizer.pad_token_id),
            micro=4,
            bf16=False,
            average=average,
        )

    model_dir = make_tiny_model_dir(tmp_path / "model", seed=0)
    summed = reference(model_dir, average=False)
    assert calls == ["average=False"]
    assert torch.equal(reference(model_dir, average=False)["train"][0], summed["train"][0])
    assert calls == ["average=False"]  # same model, same loss: read from the cache
    averaged = reference(model_dir, average=True)  # sigmoid -> ipo in the same output dir
    assert calls == ["average=False", "average=True"]
    assert not torch.equal(averaged["train"][0], summed["train"][0])
    # Other weights under the same model path (a retrained model, same architecture): recomputed.
    other = make_tiny_model_dir(model_dir, seed=1, vocab_size=128)  # an override forces a rewrite
    other_logps = reference(other, average=True)
    assert calls == ["average=False", "average=True", "average=True"]
    assert not torch.equal(other_logps["train"][0], averaged["train"][0])
    torch.load(cache, weights_only=True)  # the cache itself is plain data


# ---------------------------------------------------------------------------------------------- run dir
def test_a_second_run_into_the_same_directory_is_refused_until_overwrite(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from rlvr.cli import app

    run = tmp_path / "run"
    args = [
        "train",
        str(tiny_config_dir / "tiny.yaml"),
        "--output-dir",
        str(run),
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "tracking.progress=false",
        "--set",
        "train.steps=2",
        "--set",
        "eval.n=2",
        "--set",
        "model.bf16='off'",
    ]
    assert CliRunner().invoke(app, args).exit_code == 0
    before = (run / "metrics.jsonl").read_text()
    again = CliRunner().invoke(app, args)
    assert isinstance(again.exception, ConfigError)
    message = str(again.exception)
    assert "already holds a run" in message and "--resume" in message
    assert "--overwrite" in message and "\n" not in message
    assert (run / "metrics.jsonl").read_text() == before  # nothing appended, nothing replaced

    fresh = CliRunner().invoke(app, [*args, "--overwrite"])
    assert fresh.exit_code == 0, fresh.output
    steps = [m["step"] for m in read_metrics(run) if "loss" in m]
    assert steps == [1, 2]  # one run's rows, each step once
    (aside,) = tmp_path.glob("run.old-*")  # the old run was moved, not deleted
    assert (aside / "metrics.jsonl").read_text() == before


def test_resume_without_a_checkpoint_says_so_before_loading_anything(tmp_path: Path) -> None:
    from rlvr.train.run_dir import check_run_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"no checkpoint there to resume from.*--overwrite"):
        check_run_dir(tmp_path / "run", resume=True, overwrite=False)


def test_only_rank_0_judges_an_existing_run_directory(tmp_path: Path) -> None:
    """Under torchrun rank 0 makes the directory; a rank that starts later must not refuse it."""
    from rlvr.train.run_dir import check_run_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a run"):
        check_run_dir(tmp_path / "run", resume=False, overwrite=False, main=True)
    check_run_dir(tmp_path / "run", resume=False, overwrite=False, main=False)


def test_a_model_that_fails_to_load_leaves_no_run_directory(
    tiny_config_dir: Path, tmp_path: Path
) -> None:
    bad_model = tmp_path / "not-a-model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text("{}")  # a directory, but no model in it
    cfg = tiny_cfg(tiny_config_dir, bad_model, tmp_path / "run")
    with pytest.raises(ConfigError, match="could not load model"):
        train(cfg, config_dir=tiny_config_dir)
    assert not (tmp_path / "run").exists()


def test_resumed_summary_starts_at_the_base_eval(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ("train.steps=4", "checkpoint.every=2", "eval.n=2")
    cfg = tiny_cfg(tiny_config_dir, tiny_model_dir, tmp_path / "run", *common)

    class Stop(Exception):
        pass

    def stop_after_2(step: int, _metrics: dict[str, object]) -> None:
        if step == 2:
            raise Stop

    with pytest.raises(Stop):
        train(cfg, config_dir=tiny_config_dir, on_step_end=stop_after_2)
    capsys.readouterr()
    summary = train(cfg, resume=True, config_dir=tiny_config_dir)
    assert "resuming from step 2 (checkpoint " in capsys.readouterr().err
    assert [step for step, _ in summary.eval_history] == [0, 4]
    base = next(m for m in read_metrics(tmp_path / "run") if m["step"] == 0)
    assert summary.eval_history[0][1]["eval/accuracy"] == base["eval/accuracy"]


# ---------------------------------------------------------------------------------------------- signals
PACE = """
import time
from pathlib import Path


def pace(completion, **_):
    # Slows each step to ~0.5 s, so a signal sent when a step's metrics appear lands mid-run,
    # and leaves a line per call, so a test can tell that a step's scoring has begun.
    with open(Path(__file__).with_name("pace.calls"), "a") as calls:
        calls.write("1\\n")
    time.sleep(0.06)
    return 0.0
"""


def signal_config(tiny_config_dir: Path, tiny_model_dir: Path) -> Path:
    import yaml

    (tiny_config_dir / "pace.py").write_text(PACE)
    cfg = yaml.safe_load((tiny_config_dir / "tiny.yaml").read_text())
    cfg["model"].update({"name": str(tiny_model_dir), "bf16": "off"})
    cfg["rewards"].append({"fn": "pace.py:pace", "name": "pace", "weight": 0.0})
    cfg["sampling"].update({"prompts_per_step": 2, "group_size": 4})
    cfg["train"]["steps"] = 6
    cfg["eval"]["n"] = 4
    cfg["tracking"]["progress"] = False
    path = tiny_config_dir / "signal.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rlvr.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(proc: subprocess.Popen[str], run: Path, step: int) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and any(
            m["step"] >= step and "loss" in m for m in read_metrics(run) if "event" not in m
        ):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}: {proc.communicate()}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"step {step} never appeared")


def test_ctrl_c_saves_a_checkpoint_and_resume_matches_the_uninterrupted_run(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = signal_config(tiny_config_dir, tiny_model_dir)
    run = tmp_path / "run"
    proc = launch("train", str(config), "--output-dir", str(run))
    wait_for_step(proc, run, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    found = re.search(r"interrupted at step (\d+); resume with: rlvr train --resume (\S+)", err)
    assert found, err
    stopped = int(found.group(1))
    assert 2 <= stopped < 6 and found.group(2) == str(run)
    assert (run / "checkpoints" / f"step-{stopped:06d}" / "state.json").exists()
    assert max(m["step"] for m in read_metrics(run)) == stopped  # the step finished, no more

    resumed = launch("train", "--resume", str(run))
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    assert f"resuming from step {stopped} (checkpoint {run}/checkpoints/step-{stopped:06d})" in err
    assert re.search(r"held-out accuracy.*\(step 0\) -> .*\(step 6\)", out), out

    full = train(
        load_config(config, [f"output_dir={tmp_path / 'full'}"]), config_dir=tiny_config_dir
    )
    a, b = by_step(full.run_dir), by_step(run)
    assert sorted(a) == sorted(b) == list(range(7))
    for step in range(7):
        assert a[step] == b[step], f"step {step} differs after the interrupted run resumed"


def test_sigterm_saves_a_checkpoint_and_exits_143(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = signal_config(tiny_config_dir, tiny_model_dir)
    run = tmp_path / "run"
    proc = launch("train", str(config), "--output-dir", str(run))
    wait_for_step(proc, run, 1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    stopped = int(re.search(r"interrupted at step (\d+)", err).group(1))  # type: ignore[union-attr]
    assert (run / "checkpoints" / f"step-{stopped:06d}" / "state.json").exists()


def test_a_second_ctrl_c_stops_at_once(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = signal_config(tiny_config_dir, tiny_model_dir)
    run = tmp_path / "run"
    proc = launch("train", str(config), "--output-dir", str(run))
    wait_for_step(proc, run, 1)
    # Step 1's metrics are out, but the loop checks for a stop request just after writing them
    # (and after a checkpoint): a signal landing there ends the run at step 1 before the second
    # one arrives. Wait until step 2 is scoring its rollouts (~0.4 s of it left), then send both.
    calls = tiny_config_dir / "pace.calls"
    scored = calls.read_text().count("\n")
    deadline = time.time() + 60
    while calls.read_text().count("\n") == scored and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # mid-step: the step would take ~0.4 s more to finish
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted at step" not in err  # no step was finished, no checkpoint saved for it
    assert not list(run.glob("checkpoints/step-*"))


def test_an_interrupted_offline_stage_checkpoints_and_resumes_exactly(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlvr.errors import RunInterrupted
    from rlvr.observe.tracking import Tracker
    from rlvr.offline import SFTConfig, train_sft

    rows = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in ["cat", "dog", "sun", "red", "blue", "tree", "fish", "bird"] * 2
    ]

    def cfg(out: str) -> SFTConfig:
        return SFTConfig.model_validate(
            {
                "model": {"name": str(tiny_model_dir), "bf16": "off"},
                "output_dir": str(tmp_path / out),
                "progress": False,
                "data": {"heldout_fraction": 0.25},
                "train": {"steps": 4, "batch_size": 4, "learning_rate": 1e-3, "max_length": 64},
            }
        )

    whole = train_sft(cfg("whole"), rows=rows)
    original_log = Tracker.log
    # What the stage must restore: Python's default handler, or SIG_IGN where the test process
    # started with SIGINT ignored (a background job of a non-interactive shell, `nohup make test &`).
    handler_before = signal.getsignal(signal.SIGINT)

    def ctrl_c_during_step_2(self: Tracker, metrics: dict[str, Any], step: int) -> None:
        original_log(self, metrics, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as if typed while step 2 was running

    monkeypatch.setattr(Tracker, "log", ctrl_c_during_step_2)
    with pytest.raises(RunInterrupted, match="interrupted at step 2") as err:
        train_sft(cfg("split"), rows=rows)
    assert err.value.exit_code == 130
    assert (tmp_path / "split" / "checkpoints" / "step-000002" / "rng.json").exists()
    assert signal.getsignal(signal.SIGINT) is handler_before  # handlers restored
    monkeypatch.setattr(Tracker, "log", original_log)
    resumed = train_sft(cfg("split"), rows=rows, resume=True)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in whole.history]
