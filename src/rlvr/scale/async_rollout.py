"""Async rollouts: a background thread samples round k+1 on a copy of the policy while the learner
updates on round k: one-step off-policy, with a staleness bound (AReaL's eta, Fu et al. 2025).

    learner:   take r1 | update 1 | publish v1 | take r2 | update 2 | publish v2 | take r3 | ...
    producer:  [r1 @ v0]  [r2 @ v0 .................]  [r3 @ v1 .................]  [r4 @ v2 ...

Who samples what. Version v = the number of `publish` calls so far (v0 = the weights the copy was
taken from). Each `next_round` hands out a finished round and, with `max_staleness >= 1`, at once
asks the producer for the next one, naming the newest published weights at that moment; the
producer loads them into its copy before it starts (never in the middle of a round: a round is
sampled by one version). So in the loop (one `next_round` then one `publish` per step):

    round 1 is sampled by v0 and consumed at v0          (staleness 0: nothing to overlap with yet)
    round k >= 2 is sampled by v(k-2), consumed at v(k-1) (staleness 1)

i.e. round k is sampled by version max(0, k-2). With dynamic sampling (several rounds in a step)
every further round of a step is sampled by that step's version (staleness 0). A round whose
staleness exceeds `max_staleness` (only possible when the learner publishes more than once
between two `next_round` calls) is dropped, counted, and sampled again with the newest weights.
`max_staleness=0`: no prefetch; each `next_round` samples with the current weights and waits for
it (no overlap, but sampling still runs on the copy, so the same code path is exercised).

The off-policy gap is corrected by the update, not here: the trajectory's behaviour log-probs are
the copy's, so `objective.tis_cap` (2.0 by default with async rollouts) weights each token by
min(pi_old / pi_behaviour, cap), pi_old being the learner's current (detached) policy.

Reproducibility. The version that samples a round is fixed by the learner's call order (the request
names it), never by thread timing, for every `max_staleness`: an async run with a seeded generator
and task sampler repeats exactly (tested). That holds as long as `play` draws its randomness only
from its own seeded generators (rlvr's task samplers and HFGenerator do): anything drawing from a
global RNG (python `random`, numpy, torch's default generator) that the learner also uses would
interleave with it by timing. An async run does not equal the synchronous run with the same seed:
its rounds are sampled by other weights.

Checkpoint / resume. At a checkpoint after update k the producer has already drawn the tasks of
round k+1 (and may be sampling it). That round is not saved: a resumed run builds a new
`AsyncRollout` from the checkpoint's weights, whose first round is sampled on-policy (staleness 0)
from the next tasks of the saved sampler state, which is one round ahead: round k+1's tasks are
skipped. So a resume is not bit-identical to the uninterrupted run (the synchronous loop's is).
Call `wait_idle()` before reading state that `play` mutates (the task sampler's state, the copy's
generator RNG) so that it is read between rounds, not mid-draw. The copy's generator
(`self.generator`) starts from make_generator's seed unless its state is restored (`set_state`)
before the first `next_round`.

Thread safety: the learner trains `policy.model` while the producer samples from its own deep copy;
snapshots are CPU clones (rlvr.scale.weights), so no tensor is shared between the threads. Grad
mode, autocast and torch-function modes (the generator's SkinnyLinear) are thread-local in torch.
The price: a second copy of the model (full fine-tuning; LoRA shares nothing either, the copy
holds its own base) and, per publish, a CPU clone of the trainable weights.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from rlvr.models import Policy
from rlvr.records import Group
from rlvr.rollout.generator import Completion, Generator, SamplingParams
from rlvr.scale.weights import load_trainable_state, trainable_state

Snapshot = Mapping[str, torch.Tensor]


class _Stopped(Exception):
    """Raised inside the producer's `play` when `close()` was called: ends the round early."""


class _StoppableGenerator:
    """The copy's generator as `play` sees it: each `generate` call first checks for `close()`, so
    a multi-turn round stops at its next turn instead of playing to the end."""

    def __init__(self, inner: Generator, stop: threading.Event) -> None:
        self.inner = inner
        self._stop = stop

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        if self._stop.is_set():
            raise _Stopped
        return self.inner.generate(prompts, sampling)


class AsyncRollout:
    """A background thread samples round k+1 on a copy of the policy while the learner updates on
    round k. See the module docstring for the version schedule, reproducibility and resume.

    `make_generator(copy_model)` builds the sampling copy's generator (e.g. `lambda m:
    HFGenerator(m, tokenizer, eos, seed=...)`); `play(generator)` plays one round, drawing its tasks
    itself, and returns its groups. Build this after loading resume weights into `policy.model`:
    the copy is taken here. Use as a context manager, or call `close()` in a `finally`.
    """

    def __init__(
        self,
        policy: Policy,
        make_generator: Callable[[Any], Generator],
        play: Callable[[Generator], list[Group]],
        max_staleness: int,
        *,
        join_timeout_s: float = 30.0,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.join_timeout_s = join_timeout_s
        with torch.no_grad():
            # The sampling copy: its own tensors (a deepcopy), never trained, no grads carried over.
            self.model = copy.deepcopy(policy.model).eval().requires_grad_(False)
        for p in self.model.parameters():
            p.grad = None
        self.generator = make_generator(self.model)
        self._play = play
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        # Learner side (guarded by _cond): publishes so far and the newest snapshot.
        self._version = 0
        self._snapshot: Snapshot | None = None
        # Hand-over (guarded by _cond): the producer's next job (version, its weights), its finished
        # round (version that sampled it, groups), or the exception that ended it.
        self._request: tuple[int, Snapshot | None] | None = None
        self._result: tuple[int, list[Group]] | None = None
        self._error: BaseException | None = None
        self._busy = False
        # Producer side only: which version the copy holds.
        self._copy_version = 0
        # Metrics.
        self._dropped = 0
        self._step_wait_s = 0.0
        self._step_staleness = 0
        self._last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------ learner
    def next_round(self) -> list[Group]:
        """The next round's groups, sampled by weights at most `max_staleness` publishes old.

        Blocks until it is ready. A producer exception is re-raised here (the same exception, its
        traceback through `play`, with a note saying where it came from)."""
        if self._stop.is_set():
            raise RuntimeError("AsyncRollout.next_round after close()")
        self._start()
        started = time.perf_counter()
        with self._cond:
            if self._request is None and self._result is None and not self._busy:
                self._ask()  # nothing prefetched: the first round, or max_staleness 0
            while True:
                self._cond.wait_for(
                    lambda: (
                        self._result is not None or self._error is not None or self._stop.is_set()
                    )
                )
                if self._error is not None:
                    raise self._error
                if self._result is None:
                    raise RuntimeError("AsyncRollout closed while next_round was waiting")
                sampled_by, groups = self._result
                self._result = None
                staleness = self._version - sampled_by
                if staleness <= self.max_staleness:
                    break
                self._dropped += 1  # too old: sample it again with the newest weights
                self._ask()
            if self.max_staleness >= 1:
                self._ask()  # the next round samples while the learner updates on this one
            self._step_wait_s += time.perf_counter() - started
            self._step_staleness = max(self._step_staleness, staleness)
            self._last_metrics = {
                "async/staleness": float(self._step_staleness),
                "async/dropped_rounds": float(self._dropped),
                "async/wait_s": self._step_wait_s,
                "async/weights_version": float(sampled_by),
            }
        return groups

    def publish(self, policy: Policy) -> None:
        """After an optimizer step: the next version's weights (a CPU clone of what trains). The
        producer loads them before the next round it is asked for, never mid-round."""
        snapshot = trainable_state(policy.model)  # cloned: the learner may now train on in place
        with self._cond:
            self._version += 1
            self._snapshot = snapshot
            # A step ends at a publish: wait time (summed) and staleness (worst) restart per step.
            self._step_wait_s = 0.0
            self._step_staleness = 0

    @property
    def version(self) -> int:
        """Publishes so far (the learner's current weights version)."""
        return self._version

    @property
    def last_metrics(self) -> dict[str, float]:
        """For the round last returned: "async/staleness" (versions behind when consumed; the worst
        over the rounds returned since the last publish), "async/dropped_rounds" (cumulative),
        "async/wait_s" (learner time blocked in next_round since the last publish),
        "async/weights_version" (the version that sampled it). Empty before the first round."""
        with self._cond:
            return dict(self._last_metrics)

    def wait_idle(self) -> None:
        """Block until the producer is not sampling (a finished prefetched round stays queued for
        `next_round`). Call before reading state `play` mutates, e.g. the task sampler's state
        for a checkpoint, or `self.generator`'s RNG state. Re-raises a producer exception."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    (not self._busy and self._request is None)
                    or self._error is not None
                    or self._stop.is_set()
                )
            )
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """Stop the producer and join it. A round in progress stops at its next generate call; one
        stuck elsewhere for longer than `join_timeout_s` is left behind (a daemon thread) with a
        warning. Idempotent."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.join_timeout_s)
            if thread.is_alive():
                warnings.warn(
                    f"async rollout producer still running {self.join_timeout_s:g} s after close()",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def __enter__(self) -> AsyncRollout:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._produce, name="rlvr-async-rollout", daemon=True
            )
            self._thread.start()

    def _ask(self) -> None:
        """Ask for one round sampled by the current version (caller holds _cond). The snapshot
        travels with the request, so a publish before the producer wakes cannot change it."""
        self._request = (self._version, self._snapshot)
        self._cond.notify_all()

    # ----------------------------------------------------------------------------------- producer
    def _produce(self) -> None:
        playing = _StoppableGenerator(self.generator, self._stop)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._request is not None or self._stop.is_set())
                if self._stop.is_set():
                    return
                assert self._request is not None
                version, snapshot = self._request
                self._request = None
                self._busy = True
            try:
                if version != self._copy_version and snapshot is not None:
                    load_trainable_state(self.model, snapshot)
                    self._copy_version = version
                with torch.no_grad():  # grad mode is per thread: this one never needs a graph
                    groups = self._play(playing)
            except _Stopped:
                return
            except BaseException as err:  # never swallowed: next_round re-raises it
                if self._stop.is_set():
                    return  # closing: whatever play raised while being stopped is moot
                err.add_note(
                    f"(raised in the async rollout producer thread, sampling with weights "
                    f"version {version})"
                )
                with self._cond:
                    self._error = err
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._result = (version, groups)
                self._busy = False
                self._cond.notify_all()
