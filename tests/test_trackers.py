"""tracking.report_to: wandb (offline run files), TensorBoard (event files) and MLflow (a local file
store) get the metrics, config, event rows and rollouts of metrics.jsonl, read back with each
library's own reader, and a resume continues the same tracker run. No network."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import TrackingConfig, load_config
from rlvr.errors import ConfigError, RlvrError
from rlvr.observe.tracking import Tracker, read_metrics

LIBRARIES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def need(name: str) -> None:
    """`make setup` installs every tracker extra; CI must have them, elsewhere a missing one skips."""
    try:
        __import__(LIBRARIES[name])
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (make setup installs rlvr[{name}])")
        pytest.skip(f"{name} is not installed: pip install 'rlvr[{name}]'")


@pytest.fixture()
def offline_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """wandb offline under tmp, MLflow's file store under tmp: nothing leaves the machine."""
    for name in LIBRARIES:
        need(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    (tmp_path / "wandb_home").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database otherwise
    return tmp_path


# --- readers: each tracker's files, read back as that tracker stores them -----------------------


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run file (run-ID.wandb): a 7-byte header (":W&B", magic, version),
    then 32 KiB blocks of chunks, each with a 7-byte head (crc32, length, kind: 1 whole record,
    2 first, 3 middle, 4 last part); a block's last < 7 bytes are padding."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def wandb_runs(wandb_home: Path) -> list[dict[str, Any]]:
    """Each offline run directory (a resume adds one with the same id): id, config, history rows."""
    runs = []
    for run_file in sorted(wandb_home.glob("wandb/offline-run-*/run-*.wandb")):
        run: dict[str, Any] = {"dir": run_file.parent, "history": [], "config": {}}
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update(
                    {u.key: json.loads(u.value_json) for u in record.run.config.update}
                )
            elif kind == "history":
                run["history"].append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
        runs.append(run)
    return runs


def tensorboard_reader(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def tensorboard_text(events: Any, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)}


def mlflow_client() -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])


def mlflow_json(client: Any, run_id: str, artifact: str, into: Path) -> Any:
    return json.loads(Path(client.download_artifacts(run_id, artifact, str(into))).read_text())


# --- the Tracker itself ------------------------------------------------------------------------

CONFIG = {"algorithm": "grpo", "train": {"steps": 4, "learning_rate": 1e-5}, "sampling": {"n": 2}}
ROLLOUT = {
    "task_id": "arith:1+2",
    "source": "main",
    "completion": "3 | done\nyes",
    "messages": [{"role": "assistant", "content": "3"}],
    "reward": 1.0,
    "rewards": {"correct": 1.0},
    "errors": {},
    "finish_reason": "stop",
    "num_tokens": 2,
    "num_turns": 1,
}
ALERT = {
    "event": "echo_trap/zero_variance",
    "action": "warn",
    "message": "90% of groups had all-equal rewards",
    "evidence": {"frac_reward_zero_std": 0.9},
}


def run_steps(tracker: Tracker, steps: range, *, alert_at: int | None = None) -> None:
    for step in steps:
        tracker.log({"reward": step / 10, "rewards/correct/mean": step / 10, "note": "x"}, step)
        if step == alert_at:
            tracker.log(ALERT, step)
        tracker.log_rollouts([{**ROLLOUT, "reward": step / 10}], step)


def open_tracker(run_dir: Path, resume_step: int | None = None) -> Tracker:
    return Tracker(
        run_dir,
        report_to=["wandb", "tensorboard", "mlflow"],
        project="rlvr-test",
        run_name="trackers",
        config=CONFIG,
        resume_step=resume_step,
    )


def test_each_tracker_gets_metrics_config_events_and_rollouts_and_a_resume_continues_its_run(
    offline_trackers: Path,
) -> None:
    tmp = offline_trackers
    run_dir = tmp / "run"
    run_dir.mkdir()
    tracker = open_tracker(run_dir)
    run_steps(tracker, range(0, 5), alert_at=2)  # a run that got to step 4, then stopped
    tracker.close()
    first_ids = json.loads((run_dir / "trackers.json").read_text())
    # Resumed from the checkpoint at step 2: steps 3 and 4 are done again (equal values under exact
    # resume), then 5 and 6.
    tracker = open_tracker(run_dir, resume_step=2)
    assert [e["event"] for e in tracker.events] == [ALERT["event"]]
    run_steps(tracker, range(3, 7))
    tracker.close()
    assert json.loads((run_dir / "trackers.json").read_text()) == first_ids
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "reward" in r] == list(range(7))

    # wandb: two offline directories of one run id (`wandb sync` uploads them as one run).
    runs = wandb_runs(tmp / "wandb_home")
    assert len(runs) == 2
    assert {r["id"] for r in runs} == {first_ids["wandb"]["id"]}
    assert runs[0]["config"]["train"] == CONFIG["train"]
    history = [h for r in runs for h in r["history"]]
    reward_steps = [h["_step"] for h in history if "reward" in h]
    assert reward_steps == [0, 1, 2, 3, 4, 5, 6]  # 3 and 4 were not sent twice
    assert all("note" not in h for h in history)  # numbers only, as for trackio
    assert {h["rewards/correct/mean"] for h in history if h["_step"] == 6} == {0.6}
    assert [h["_step"] for h in history if "events/_type" in h] == [2]
    rollout_steps = [h["_step"] for h in history if h.get("rollouts/_type") == "table-file"]
    assert rollout_steps == list(range(7))
    table_file = next(iter((runs[1]["dir"] / "files").glob("media/table/rollouts_6_*.table.json")))
    table = json.loads(table_file.read_text())
    row = dict(zip(table["columns"], table["data"][0], strict=True))
    assert (row["step"], row["reward"], row["task_id"]) == (6, 0.6, "arith:1+2")
    assert json.loads(row["rewards"]) == {"correct": 1.0}
    events_file = next(iter((runs[0]["dir"] / "files").glob("media/table/events_2_*.table.json")))
    events_table = json.loads(events_file.read_text())
    event = dict(zip(events_table["columns"], events_table["data"][0], strict=True))
    assert event["event"] == ALERT["event"]

    # TensorBoard: the resume purged steps 3-4 and wrote them again; one value per step.
    tb = tensorboard_reader(run_dir / "tensorboard")
    scalars = [(s.step, s.value) for s in tb.Scalars("reward")]
    assert scalars == [(k, pytest.approx(k / 10)) for k in range(7)]
    assert "note" not in tb.Tags()["scalars"]
    assert '"learning_rate": 1e-05' in tensorboard_text(tb, "config/text_summary")[0]
    alert_text = tensorboard_text(tb, f"events/{ALERT['event']}/text_summary")
    assert list(alert_text) == [2] and ALERT["message"] in alert_text[2]
    rollouts = tensorboard_text(tb, "rollouts/text_summary")
    assert sorted(rollouts) == list(range(7))
    assert "3 \\| done<br>yes" in rollouts[5]  # one table row per rollout, cells escaped

    # MLflow: one run, config as params and artifact, every step once, tables as artifacts.
    client = mlflow_client()
    run_id = first_ids["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.learning_rate"] == "1e-05"
    assert run.data.params["algorithm"] == "grpo"
    # A file store turns "/" in metric names into "." (a name cannot be a file and a folder).
    history_ml = client.get_metric_history(run_id, "rewards.correct.mean")
    assert sorted((m.step, m.value) for m in history_ml) == [(k, k / 10) for k in range(7)]
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "rlvr-test"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert mlflow_json(client, run_id, "config.json", tmp / "dl")["train"] == CONFIG["train"]
    events = mlflow_json(client, run_id, "events.json", tmp / "dl")
    assert [r[1] for r in events["data"]] == [ALERT["event"]]
    step6 = mlflow_json(client, run_id, "rollouts/step_000006.json", tmp / "dl")
    assert dict(zip(step6["columns"], step6["data"][0], strict=True))["reward"] == 0.6


def test_a_missing_tracker_library_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError) as e:
        Tracker(tmp_path, report_to=["wandb"], project="p", run_name="r", config={})
    assert str(e.value) == (
        "tracking.report_to has wandb, but its library is not installed: pip install 'rlvr[wandb]'"
    )
    assert "\n" not in str(e.value)


def test_wandb_without_a_login_says_how_to_log_in_or_go_offline(
    offline_trackers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(offline_trackers))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(RlvrError) as e:  # refused before any request: no network needed
        Tracker(offline_trackers, report_to=["wandb"], project="p", run_name="r", config={})
    assert "WANDB_MODE=offline" in str(e.value) and "wandb login" in str(e.value)
    assert "\n" not in str(e.value)


def test_report_to_takes_trls_spellings(tmp_path: Path) -> None:
    assert TrackingConfig().trackers == ["trackio"]
    assert TrackingConfig(report_to="none").trackers == []  # type: ignore[arg-type]
    assert TrackingConfig(report_to="wandb").trackers == ["wandb"]  # type: ignore[arg-type]
    both = TrackingConfig(report_to=["trackio", "mlflow", "mlflow"], trackio=False)
    assert both.trackers == ["mlflow"]  # `trackio: false` (older configs) still turns it off
    path = tmp_path / "c.yaml"
    path.write_text("tracking:\n  report_to: [tensorboard, wandb]\n")
    assert load_config(path).tracking.trackers == ["tensorboard", "wandb"]
    assert load_config(path, ["tracking.report_to=none"]).tracking.trackers == []
    with pytest.raises(ConfigError, match="report_to"):
        load_config(path, ["tracking.report_to=[comet]"])


# --- through the training loop -----------------------------------------------------------------


def test_training_and_its_resume_log_one_run_per_tracker(
    offline_trackers: Path, tiny_config_dir: Path, tiny_model_dir: Path
) -> None:
    from rlvr.train.loop import train

    tmp = offline_trackers
    cfg = load_config(
        tiny_config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp / 'run'}",
            "model.bf16=off",
            "tracking.progress=false",
            "tracking.report_to=[wandb, tensorboard, mlflow]",
            "train.steps=4",
            "checkpoint.every=2",
            "eval.n=2",
        ],
    )

    class Stop(Exception):
        pass

    def stop_after_3(step: int, _metrics: dict[str, object]) -> None:
        if step == 3:
            raise Stop

    with pytest.raises(Stop):
        train(cfg, config_dir=tiny_config_dir, on_step_end=stop_after_3)
    train(cfg, resume=True, config_dir=tiny_config_dir)
    ids = json.loads((tmp / "run" / "trackers.json").read_text())
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp / "run") if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]

    runs = wandb_runs(tmp / "wandb_home")
    assert [r["id"] for r in runs] == [ids["wandb"]["id"]] * 2
    wandb_loss = {h["_step"]: h["loss"] for r in runs for h in r["history"] if "loss" in h}
    assert wandb_loss == pytest.approx(losses)  # step 3, redone after the resume, sent once
    tb = tensorboard_reader(tmp / "run" / "tensorboard")
    assert {s.step: s.value for s in tb.Scalars("loss")} == pytest.approx(losses)
    client = mlflow_client()
    ml = client.get_metric_history(ids["mlflow"]["run_id"], "loss")
    assert len(ml) == len(losses)  # step 3 once
    assert {m.step: m.value for m in ml} == pytest.approx(losses)
    names = client.get_run(ids["mlflow"]["run_id"]).data.metrics
    assert {"eval.accuracy", "eval.errors", "eval.errors.reward"} <= set(names)
