"""The trackers `tracking.report_to` names, each through its own library (docs/tracking.md).

Every tracker gets the same rows metrics.jsonl holds, under the same names: the numeric metrics of a
step, the config once, event rows (alerts, curriculum promotions) and the step's rollouts as a table
where the tracker has tables. wandb, tensorboard and mlflow are optional extras, imported only when
named; trackio is a dependency (the default).

A resumed run continues the same tracker run: what names it (wandb's run id, mlflow's run id) is kept
in RUN_DIR/trackers.json, written when the run starts.

`report_to` names a tracker the way every extension is named (rlvr.registry): a built-in of
`BUILTIN_TRACKERS`, 'file.py:MyTracker', 'package.module:MyTracker' or an installed plug-in (entry
point group `rlvr.trackers`). A tracker is a `Backend` subclass built from a `TrackerStart`
(docs/extending.md has one with its resume).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rlvr.errors import ConfigError, RlvrError
from rlvr.registry import TRACKERS

STATE_FILE = "trackers.json"
EVENT_COLUMNS = ["step", "event", "action", "message", "details"]
ROLLOUT_COLUMNS = [
    "step",
    "task_id",
    "source",
    "reward",
    "rewards",
    "completion",
    "messages",
    "finish_reason",
    "num_tokens",
    "num_turns",
    "errors",
]


def require_trackers(names: Sequence[str]) -> None:
    """Fail before the model loads when a named tracker is unknown or its library not installed."""
    import importlib.util

    for name in names:
        tracker: type[Backend] = TRACKERS.resolve(name)
        for library in tracker.requires:
            if importlib.util.find_spec(library) is None:
                how = tracker.install or f"pip install {library}"
                raise ConfigError(
                    f"tracking.report_to has {name}, but its library is not installed: {how}"
                )


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _cell(value: Any) -> Any:
    """Table cells are scalars: nested values (messages, reward components) as JSON text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value)


def rollout_table(rows: list[dict[str, Any]], step: int) -> list[list[Any]]:
    return [[_cell({"step": step, **row}.get(c)) for c in ROLLOUT_COLUMNS] for row in rows]


def event_row(event: dict[str, Any]) -> list[Any]:
    details = {k: v for k, v in event.items() if k not in ("step", "time", *EVENT_COLUMNS)}
    return [
        event.get("step"),
        event.get("event"),
        event.get("action", ""),
        event.get("message", ""),
        json.dumps(details),
    ]


@dataclass(frozen=True)
class TrackerStart:
    """What a tracker is built from. `resume_step` is the checkpoint a resumed run continues from
    (None on a fresh run); `saved` is what this tracker's `state()` returned when the run last
    started ({} on a fresh run, or when it was not used then)."""

    run_dir: Path
    project: str
    run_name: str
    config: dict[str, Any]
    resume_step: int | None = None
    saved: dict[str, Any] = field(default_factory=dict)


class Backend:
    """One tracker; subclass it to add one (docs/extending.md).

    `__init__(start: TrackerStart)` opens the tracker's run: on resume (`start.resume_step` set),
    the same run again, found from `start.saved`. `state()` returns what RUN_DIR/trackers.json keeps
    for that (under `name`). `log` gets a step's numeric metrics, `log_event` an alert or curriculum
    event, `log_rollouts` the step's rollout rows, `close` ends the run.

    `resumed_upto`: the last step the tracker's run already holds when a resumed run continues it;
    wandb and mlflow keep what they were sent (wandb refuses an earlier step), so the redone steps
    after the checkpoint, equal under an exact resume, are not sent twice (`sends`).
    `requires`: modules that must be importable (checked before the model loads), and `install`
    the line that says how to get them.
    """

    name = ""
    requires: tuple[str, ...] = ()
    install = ""
    resumed_upto: int | None = None

    def __init__(self, start: TrackerStart) -> None:
        self.start = start

    def state(self) -> dict[str, Any]:
        """What RUN_DIR/trackers.json keeps so that a resume continues this tracker's run."""
        return {}

    def sends(self, step: int) -> bool:
        return self.resumed_upto is None or step > self.resumed_upto

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_event(self, event: dict[str, Any], events: list[dict[str, Any]], step: int) -> None:
        """`events`: every event row of the run so far, this one last (trackers redraw a table)."""

    def log_rollouts(self, rows: list[dict[str, Any]], step: int) -> None: ...

    def close(self) -> None: ...


class TrackioBackend(Backend):
    """Local, no server (the default). A resume reopens the run of the same name."""

    name = "trackio"
    requires = ("trackio",)
    install = "pip install trackio"

    def __init__(self, start: TrackerStart) -> None:
        import trackio

        trackio.init(
            project=start.project,
            name=start.run_name,
            config=start.config,
            resume="allow" if start.resume_step is not None else "never",
            embed=False,
        )
        self._trackio = trackio

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._trackio.log(metrics, step=step)

    def close(self) -> None:
        self._trackio.finish()


class WandbBackend(Backend):
    """Weights & Biases: online, or WANDB_MODE=offline (sync later with `wandb sync`). Files go to
    WANDB_DIR when set, else the run directory. Rollouts are a `rollouts` Table per step, events an
    `events` Table redrawn at each event, plus `run.alert` (a notification on online runs)."""

    name = "wandb"
    requires = ("wandb",)
    install = "pip install 'rlvr[wandb]'"

    def __init__(self, start: TrackerStart) -> None:
        import wandb

        self._wandb: Any = wandb
        project, run_name, config, run_dir = (
            start.project,
            start.run_name,
            start.config,
            start.run_dir,
        )
        run_id = start.saved.get("id")
        mode: Any = os.environ.get("WANDB_MODE") or None  # online, offline, disabled
        try:
            self._run = wandb.init(
                project=project,
                name=run_name,
                config=config,
                id=run_id,
                resume="allow" if run_id else None,
                # Read here, not left to wandb: it reads WANDB_* once per process.
                dir=os.environ.get("WANDB_DIR") or str(run_dir),
                mode=mode,
            )
        except Exception as e:  # no API key, no network: one line, and the ways out
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RlvrError(
                f"wandb could not start a run ({first}); log in with `wandb login`, set "
                "WANDB_API_KEY, or run with WANDB_MODE=offline"
            ) from e

    def state(self) -> dict[str, Any]:
        return {"id": self._run.id, "project": self._run.project}

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.sends(step):
            self._run.log(metrics, step=step)

    def log_event(self, event: dict[str, Any], events: list[dict[str, Any]], step: int) -> None:
        if not self.sends(step):
            return
        table = self._wandb.Table(columns=EVENT_COLUMNS, data=[event_row(e) for e in events])
        self._run.log({"events": table}, step=step)
        if event.get("action") in ("warn", "stop", "mitigate"):  # alerts, not promotions
            self._run.alert(
                title=str(event["event"]),
                text=f"step {step}: {event.get('message', '')}",
                level="WARN",
            )

    def log_rollouts(self, rows: list[dict[str, Any]], step: int) -> None:
        if self.sends(step) and rows:
            table = self._wandb.Table(columns=ROLLOUT_COLUMNS, data=rollout_table(rows, step))
            self._run.log({"rollouts": table}, step=step)

    def close(self) -> None:
        self._run.finish()


def _markdown_cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


class TensorBoardBackend(Backend):
    """Event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`). Scalars by
    name; config, events and rollouts as text (markdown). A resume purges what was written after
    the checkpoint (purge_step), so the redone steps replace the old ones."""

    name = "tensorboard"
    requires = ("tensorboard",)
    install = "pip install 'rlvr[tensorboard]'"

    def __init__(self, start: TrackerStart) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = start.run_dir / "tensorboard"
        purge = None if start.resume_step is None else start.resume_step + 1
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)
        if start.resume_step is None:
            text = json.dumps(start.config, indent=2)
            self._writer.add_text("config", f"```\n{text}\n```", 0)

    def state(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir)}

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # a crash loses nothing logged (the writer buffers for 2 minutes)

    def log_event(self, event: dict[str, Any], events: list[dict[str, Any]], step: int) -> None:
        details = event_row(event)[-1]
        text = f"**{event.get('action', '')}**: {event.get('message', '')}\n\n`{details}`"
        self._writer.add_text(f"events/{event['event']}", text, step)
        self._writer.flush()

    def log_rollouts(self, rows: list[dict[str, Any]], step: int) -> None:
        if not rows:
            return
        lines = ["| " + " | ".join(ROLLOUT_COLUMNS) + " |", "|" + "---|" * len(ROLLOUT_COLUMNS)]
        lines += [
            "| " + " | ".join(_markdown_cell(c) for c in row) + " |"
            for row in rollout_table(rows, step)
        ]
        self._writer.add_text("rollouts", "\n".join(lines), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# mlflow's metric and param names: letters, digits, _ - . space : and /.
_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


class MlflowBackend(Backend):
    """MLflow through its client: the store MLFLOW_TRACKING_URI names (a server, or a local store),
    experiment MLFLOW_EXPERIMENT_NAME or tracking.project. Config as params (dotted keys) and the
    artifact config.json; rollouts a table artifact per step (rollouts/step_000001.json, log_table:
    the UI shows it); events the table artifact events.json."""

    name = "mlflow"
    requires = ("mlflow",)
    install = "pip install 'rlvr[mlflow]'"

    def __init__(self, start: TrackerStart) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        project, run_name, config, run_dir = (
            start.project,
            start.run_name,
            start.config,
            start.run_dir,
        )
        saved = start.saved
        uri = saved.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        try:
            self._client = MlflowClient(tracking_uri=uri)
            if saved.get("run_id"):
                self.run_id = saved["run_id"]
                self._client.update_run(self.run_id, status="RUNNING")
            else:
                experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or project
                found = self._client.get_experiment_by_name(experiment)
                experiment_id = (
                    found.experiment_id if found else self._client.create_experiment(experiment)
                )
                run = self._client.create_run(
                    experiment_id, run_name=run_name, tags={"rlvr.run_dir": str(run_dir)}
                )
                self.run_id = run.info.run_id
            self.tracking_uri = self._client.tracking_uri
            # The file store keeps a metric as a file named by its path: `eval/errors` (a file) and
            # `eval/errors/reward` (under a folder of that name) cannot both be. There, and only
            # there, "/" in a metric name becomes "." (docs/tracking.md).
            self._file_store = urlparse(self.tracking_uri).scheme in ("", "file")
            # Params cannot change once logged: a resume adds only new keys (the artifact has all).
            have = self._client.get_run(self.run_id).data.params
            params = [
                Param(_MLFLOW_BAD.sub("_", k)[:250], str(v)[:6000])
                for k, v in _flatten(config).items()
            ]
            params = [p for p in params if p.key not in have]
            for i in range(0, len(params), 100):  # mlflow's batch limit
                self._client.log_batch(self.run_id, params=params[i : i + 100])
            self._client.log_dict(self.run_id, config, "config.json")
        except MlflowException as e:
            first = str(e).strip().splitlines()[0][:300]
            raise RlvrError(
                f"mlflow could not open a run at {uri or 'its default store'}: {first} "
                "(set MLFLOW_TRACKING_URI; docs/tracking.md)"
            ) from e

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if not self.sends(step):
            return
        now = int(time.time() * 1000)
        batch = [Metric(self._metric_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self._client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def _metric_name(self, name: str) -> str:
        name = _MLFLOW_BAD.sub("_", name)
        return name.replace("/", ".") if self._file_store else name

    def log_event(self, event: dict[str, Any], events: list[dict[str, Any]], step: int) -> None:
        if self.sends(step):
            table = {"columns": EVENT_COLUMNS, "data": [event_row(e) for e in events]}
            self._client.log_dict(self.run_id, table, "events.json")  # redrawn, never appended

    def log_rollouts(self, rows: list[dict[str, Any]], step: int) -> None:
        if self.sends(step) and rows:
            columns = list(zip(*rollout_table(rows, step), strict=True))
            data = {name: list(col) for name, col in zip(ROLLOUT_COLUMNS, columns, strict=True)}
            self._client.log_table(self.run_id, data, f"rollouts/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list | dict) else value
    return flat


# The built-in trackers, by the name `report_to` gives them (as TRL spells them).
BUILTIN_TRACKERS: dict[str, type[Backend]] = {
    "trackio": TrackioBackend,
    "wandb": WandbBackend,
    "tensorboard": TensorBoardBackend,
    "mlflow": MlflowBackend,
}


def as_tracker_class(obj: Any, ref: str) -> type[Backend]:
    """`obj` if it is a Backend subclass (rlvr.registry's check for `tracking.report_to`)."""
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise ConfigError(
            f"tracking.report_to {ref!r} is not a tracker: a subclass of "
            "rlvr.observe.trackers.Backend (docs/extending.md)"
        )
    return obj


def open_backends(
    run_dir: Path,
    names: Sequence[str],
    *,
    project: str,
    run_name: str,
    config: dict[str, Any],
    resume_step: int | None,
    resumed_upto: int | None,
) -> list[Backend]:
    """Start (or, on resume, continue) each named tracker; record their run ids in trackers.json,
    each under its `name` (the config's name for it when the class sets none)."""
    require_trackers(names)
    path = run_dir / STATE_FILE
    saved = json.loads(path.read_text()) if resume_step is not None and path.exists() else {}
    backends: list[Backend] = []
    keys: list[str] = []
    for name in names:
        tracker: type[Backend] = TRACKERS.resolve(name)
        key = tracker.name or name
        start = TrackerStart(
            run_dir, project, run_name, config, resume_step, dict(saved.get(key) or {})
        )
        backend = tracker(start)
        if saved.get(key):  # the same tracker run as before the stop
            backend.resumed_upto = resumed_upto
        backends.append(backend)
        keys.append(key)
    state = {**saved, **{k: b.state() for k, b in zip(keys, backends, strict=True) if b.state()}}
    if state:  # kept for trackers left out of this resume too: a later one may name them again
        path.write_text(json.dumps(state, indent=2) + "\n")
    return backends
