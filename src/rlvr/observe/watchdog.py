"""Hang watchdog: per-phase deadlines; a phase past its deadline ends the run with its stacks on disk.

Code that may hang runs inside `watch(phase, detail)`: the generator call (rollout/engine.py), each
env.reset / env.step (engine), each reward function call (verifiers/rubric.py), the policy update
(train/loop.py) and each HTTP request to a generation server (rollout/server.py). `watch` is a no-op
unless a `Watchdog` is installed (train() installs one from the `watchdog:` config section) and that
phase has a deadline (0 = not watched). Phases may nest and run in several threads at once (env
steps and parallel rewards run in worker threads); each call is watched on its own.

When a watched call runs past its deadline, the watchdog thread
- writes every thread's Python stack (named threads first, then faulthandler's dump) to
  RUN_DIR/hang_stacks.txt, the hung thread first;
- prints which phase hung, for how long, in which function, and appends a `watchdog/hang` event
  row to metrics.jsonl;
- saves no checkpoint: the main thread is mid-step (weights or optimizer may be half-updated, and a
  save from another thread would race with it), so the message names the last checkpoint saved at
  the end of a completed step, which `rlvr train --resume` continues from;
- stops what the run launched (a generation server in its own process group) and exits with
  `EXIT_CODE` (124, as coreutils' `timeout`) via os._exit: a hung thread cannot be joined.

A hang that holds the GIL (a C extension that never releases it, e.g. catastrophic backtracking in
`re`) starves the watchdog thread. For that case faulthandler's C-level timer is kept armed at the
nearest deadline + `backstop_grace_s`; it dumps the raw stacks into the same file and exits with
code 1 (faulthandler's), without the message.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import math
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

PHASES = ("generation", "env_step", "reward", "update", "server_request")
EXIT_CODE = 124
STACKS_FILE = "hang_stacks.txt"
# The stack file exists while phases are watched (faulthandler's backstop needs it open); it says so,
# and is removed at a clean close when it holds only this line.
_PLACEHOLDER = "# rlvr watchdog: nothing has hung (stacks are written here if a phase does)\n"

# The C timer is moved only when the nearest deadline moved by more than this (each move starts a
# thread inside faulthandler); being this early against a deadline of minutes does not matter.
_BACKSTOP_SLACK_S = 1.0

_current: Watchdog | None = None


@contextlib.contextmanager
def watch(phase: str, detail: str = "") -> Iterator[None]:
    """Watch the enclosed call as `phase` (one of PHASES) when a watchdog with a deadline for it is
    installed; `detail` names what runs (a reward's name, a URL path) in the hang message."""
    dog = _current
    if dog is None or not dog.deadlines.get(phase):
        yield
        return
    token = dog.arm(phase, detail)
    try:
        yield
    finally:
        dog.disarm(token)


@dataclass(frozen=True)
class _Arm:
    phase: str
    detail: str
    started: float  # time.monotonic()
    deadline: float  # seconds
    thread: int  # threading.get_ident() of the watched call
    thread_name: str

    def due(self) -> float:
        return self.started + self.deadline


class Watchdog:
    """Deadlines per phase (seconds, 0 = off) over `run_dir`. `start()` installs it as the process's
    watchdog and starts its thread; `close()` undoes both. `step` is the step in progress (set by the
    loop, for the message); `on_hang` callbacks run before the exit (e.g. stop a launched server).
    `last_checkpoint` returns the checkpoint a resume would start from, for the message (the trainer
    passes its own lookup: observers do not import the trainer). `exit` is os._exit in a run; tests
    pass a recorder."""

    def __init__(
        self,
        deadlines: Mapping[str, float],
        run_dir: str | Path,
        *,
        backstop_grace_s: float = 10.0,
        rank: int = 0,
        write_event: bool = True,
        last_checkpoint: Callable[[], Path | None] = lambda: None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        unknown = set(deadlines) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown watchdog phase(s) {sorted(unknown)}; known: {PHASES}")
        self.deadlines = {p: float(s) for p, s in deadlines.items() if s and s > 0}
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / (STACKS_FILE if rank == 0 else f"hang_stacks.rank{rank}.txt")
        self.grace = backstop_grace_s
        self._slack = min(_BACKSTOP_SLACK_S, backstop_grace_s / 2)
        self.write_event = write_event
        self.last_checkpoint = last_checkpoint
        self.exit = exit
        self.step = 0
        self.on_hang: list[Callable[[], Any]] = []
        self.fired: _Arm | None = None
        self._arms: dict[int, _Arm] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: IO[str] | None = None
        self._backstop_at = math.inf  # monotonic time faulthandler's timer is set for
        shortest = min(self.deadlines.values(), default=10.0)
        self.tick = min(0.5, max(0.05, shortest / 20))

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str | Path, **kwargs: Any) -> Watchdog:
        """From a `WatchdogConfig` (rlvr.config): `<phase>_s` per phase."""
        deadlines = {p: float(getattr(cfg, f"{p}_s")) for p in PHASES}
        return cls(deadlines, run_dir, backstop_grace_s=cfg.backstop_grace_s, **kwargs)

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> Watchdog:
        global _current
        if not self.deadlines:
            return self  # nothing to watch: no thread, no file
        _current = self
        self._thread = threading.Thread(target=self._run, name="rlvr-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        global _current
        if _current is self:
            _current = None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            self._cancel_backstop()
            if self._file is not None and self.fired is None:
                self._file.close()
                self._file = None
                with contextlib.suppress(OSError):
                    if self.path.read_text() == _PLACEHOLDER:
                        self.path.unlink()

    # ----------------------------------------------------------------------------------------- arms
    def arm(self, phase: str, detail: str = "") -> int:
        now = time.monotonic()
        current = threading.current_thread()
        arm = _Arm(phase, detail, now, self.deadlines[phase], current.ident or 0, current.name)
        with self._lock:
            token = next(self._ids)
            self._arms[token] = arm
            # Here, in the calling thread: if this call then holds the GIL, the watchdog thread
            # never runs again and only the C timer, as set now, can act.
            if self.fired is None:
                self._follow_nearest(now)
        return token

    def disarm(self, token: int) -> None:
        # Nothing else: the C timer is moved by the next arm() or tick, not per call (each move
        # starts a thread inside faulthandler; quick calls in a row would pay that every time).
        with self._lock:
            self._arms.pop(token, None)

    def _follow_nearest(self, now: float) -> None:
        """Keep the C timer at the nearest deadline watched + grace (lock held): earlier at once,
        later once it lags by more than the slack; off when nothing is watched."""
        if not self._arms:
            self._cancel_backstop()
            return
        at = min(a.due() for a in self._arms.values()) + self.grace
        if abs(at - self._backstop_at) > self._slack:
            self._set_backstop(at, now)

    def _set_backstop(self, at: float, now: float) -> None:
        """faulthandler's C timer to fire at monotonic time `at` (lock held)."""
        if self._file is None:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "w")  # noqa: SIM115 - faulthandler keeps it open
                self._file.write(_PLACEHOLDER)
                self._file.flush()
            except OSError:
                return  # no backstop without a file; the Python watchdog still works
        faulthandler.dump_traceback_later(max(at - now, 0.001), exit=True, file=self._file)
        self._backstop_at = at

    def _cancel_backstop(self) -> None:
        if self._backstop_at < math.inf:
            faulthandler.cancel_dump_traceback_later()
            self._backstop_at = math.inf

    # ------------------------------------------------------------------------------------- watching
    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                late = [a for a in self._arms.values() if now > a.due()]
                if not late:
                    self._follow_nearest(now)
            if late:
                self._fire(max(late, key=lambda a: now - a.due()), late, now)
                return

    def _fire(self, arm: _Arm, late: list[_Arm], now: float) -> None:
        """Dump, report, stop what was launched, exit (see the module docstring)."""
        with self._lock:
            self.fired = arm
            # The report must finish: re-arm the C timer as a last resort if it hangs itself.
            self._set_backstop(now + max(self.grace, 10.0), now)
        elapsed = now - arm.started
        frames = sys._current_frames()
        where = _where(frames.get(arm.thread))
        what = f"'{arm.phase}'" + (f" ({arm.detail})" if arm.detail else "")
        others = [a for a in late if a is not arm]
        message = (
            f"watchdog: phase {what} hung for {elapsed:.1f} s at step {self.step}, past its "
            f"deadline of {arm.deadline:g} s (watchdog.{arm.phase}_s), in thread "
            f"'{arm.thread_name}'{f' in {where}' if where else ''}"
            + "".join(
                f"; {n} more '{phase}' call(s) past the deadline"
                for phase, n in Counter(a.phase for a in others).items()
            )
        )
        self._write_stacks(message, arm, frames)
        checkpoint = self._checkpoint()
        resume = (
            f"the last checkpoint is {checkpoint} (rlvr train --resume {self.run_dir})"
            if checkpoint
            else "there is no checkpoint yet (checkpoint.every saves them)"
        )
        full = (
            f"{message}. Stacks of every thread: {self.path}. No checkpoint is saved now (the "
            f"step is half done); {resume}. Exiting with code {EXIT_CODE}."
        )
        if self.write_event:
            self._event(arm, elapsed, full)
        print(full, file=sys.stderr, flush=True)
        for callback in self.on_hang:
            with contextlib.suppress(Exception):
                callback()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self.exit(EXIT_CODE)

    def _write_stacks(self, message: str, arm: _Arm, frames: dict[int, FrameType]) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        order = sorted(frames, key=lambda ident: (ident != arm.thread, names.get(ident, "")))
        lines = [f"# {message}\n\n"]
        for ident in order:
            if ident == threading.get_ident():
                continue  # this watchdog thread
            mark = "  <- hung" if ident == arm.thread else ""
            lines.append(f"Thread '{names.get(ident, '?')}' ({ident}){mark}:\n")
            lines.extend(traceback.format_stack(frames[ident]))
            lines.append("\n")
        lines.append("# faulthandler's dump of the same moment (C-level view):\n")
        try:
            with self._lock:
                f = self._file
                if f is None:
                    f = self._file = open(self.path, "w")  # noqa: SIM115 - closed at exit
                f.seek(0)
                f.truncate()
                f.write("".join(lines))
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.flush()
        except OSError as err:
            print(f"watchdog: could not write {self.path}: {err}", file=sys.stderr, flush=True)

    def _checkpoint(self) -> Path | None:
        # Called from the watchdog thread while the run is hung: a failing lookup must not stop the
        # stacks, the event and the exit that follow.
        try:
            return self.last_checkpoint()
        except Exception:
            return None

    def _event(self, arm: _Arm, elapsed: float, message: str) -> None:
        # The loop's tracker opens metrics.jsonl per write, so appending a line here is safe.
        row = {
            "step": self.step,
            "time": round(time.time(), 3),
            "event": "watchdog/hang",
            "action": "exit",
            "message": message,
            "evidence": {"elapsed_s": round(elapsed, 3), "deadline_s": arm.deadline},
            "phase": arm.phase,
        }
        with contextlib.suppress(OSError), (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


_LIBRARY = tuple(
    str(Path(p)) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}
)


def _where(frame: FrameType | None) -> str:
    """'function (file:line)' of the innermost frame, and of the innermost frame outside the
    standard library and installed packages when that is another (the user's code that waits)."""
    if frame is None:
        return ""

    def name(f: FrameType) -> str:
        return f"{f.f_code.co_name} ({Path(f.f_code.co_filename).name}:{f.f_lineno})"

    out, f = name(frame), frame
    while f is not None and f.f_code.co_filename.startswith(_LIBRARY):
        f = f.f_back  # type: ignore[assignment]
    if f is not None and f is not frame:
        out += f" called from {name(f)}"
    return out
