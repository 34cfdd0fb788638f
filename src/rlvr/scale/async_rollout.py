"""Async rollouts: a background thread samples the next rounds on a copy of the policy while the
learner updates on this one: up to `max_staleness` (k) updates off-policy, AReaL's staleness bound eta
(Fu et al. 2025).

    k = 1   learner:   take r1 | update 1 | publish v1 | take r2 | update 2 | publish v2 | take r3 ...
            producer:  [r1 @ v0]  [r2 @ v0 .................]  [r3 @ v1 .................]  [r4 @ v2

Who samples what. Version v = the number of `publish` calls so far (v0 = the weights the copy was
taken from). The producer plays the requested rounds in order; each request names the newest
published weights at the moment it is made, and the producer loads them into its copy before the
round starts (never in the middle of a round: a round is sampled by one version). `next_round` hands
out the oldest finished round and then tops the requests in flight up to k, so the producer may run k
rounds ahead of the learner. In the loop (one `next_round` then one `publish` per step):

    round 1 is sampled by v0 and consumed at v0                 (staleness 0: nothing to overlap yet)
    round i >= 2 is sampled by v(max(0, i-1-k)), consumed at v(i-1)   (staleness min(i-1, k))

so with k = 2 rounds 1-3 are sampled by v0 and round i >= 3 is consumed two versions after the
weights that sampled it. With dynamic sampling (several rounds in a step) each further round of a
step is asked at that step's version. A round whose staleness exceeds k (only possible when the
learner publishes more than once between two `next_round` calls) is dropped, counted, and asked
again with the newest weights (at the back of the queue). `max_staleness=0`: no prefetch; each
`next_round` samples with the current weights and waits for it (no overlap, but sampling still runs
on the copy, so the same code path is exercised).

Each trajectory handed out carries the version that sampled it in `info["weights_version"]`; the
step's metrics give the staleness (learner version - that) per trajectory: `rollout/staleness_mean`,
`rollout/staleness_max` and the histogram `rollout/staleness_hist/<s>` (fraction of the step's
trajectories s versions old, s = 0..k).

The off-policy gap is corrected by the update, not here: the trajectory's behaviour log-probs are
the copy's, so `objective.off_policy_correction` (truncated IS per token with `objective.tis_cap`
2.0 unless set: rlvr.algorithms.off_policy) weights or masks each token by pi_old / pi_behaviour,
pi_old being the learner's current (detached) policy.

Reproducibility. The version that samples a round is fixed by the learner's call order (the request
names it), never by thread timing, for every `max_staleness`: an async run with a seeded generator
and task sampler repeats exactly (tested). That holds as long as `play` draws its randomness only
from its own seeded generators (rlvr's task samplers and HFGenerator do): anything drawing from a
global RNG (python `random`, numpy, torch's default generator) that the learner also uses would
interleave with it by timing. An async run does not equal the synchronous run with the same seed:
its rounds are sampled by other weights.

Checkpoint / resume. At a checkpoint after update i the producer has already drawn the tasks of up
to k rounds after it (and may be sampling them). They are not saved: a resumed run builds a new
`AsyncRollout` from the checkpoint's weights, whose first round is sampled on-policy (staleness 0)
from the next tasks of the saved sampler state, which is up to k rounds ahead: those rounds' tasks
are skipped. So a resume is not bit-identical to the uninterrupted run (the synchronous loop's is).
Call `wait_idle()` before reading state that `play` mutates (the task sampler's state, the copy's
generator RNG) so that it is read between rounds, not mid-draw. The copy's generator
(`self.generator`) starts from make_generator's seed unless its state is restored (`set_state`)
before the first `next_round`.

Thread safety: the learner trains `policy.model` while the producer samples from its own deep copy;
snapshots are CPU clones (rlvr.scale.weights), so no tensor is shared between the threads. Grad
mode, autocast and torch-function modes (the generator's SkinnyLinear) are thread-local in torch.
The price: a second copy of the model (full fine-tuning; LoRA shares nothing either, the copy
holds its own base), per publish a CPU clone of the trainable weights, and with k >= 2 up to k
such clones held by queued requests (full fine-tuning: k copies of the weights in host memory).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from rlvr.models import Policy
from rlvr.records import Group
from rlvr.rollout.generator import Completion, Generator, SamplingParams
from rlvr.scale.weights import load_trainable_state, trainable_state

Snapshot = Mapping[str, torch.Tensor]


def staleness_metrics(staleness_per_trajectory: Sequence[int], bound: int) -> dict[str, float]:
    """`rollout/staleness_mean` and `_max` over trajectories (versions between the weights that
    sampled each and the learner's when it trains on it) and the histogram
    `rollout/staleness_hist/<s>`: the fraction of trajectories s versions old, s = 0..bound."""
    n = len(staleness_per_trajectory)
    if n == 0:
        return {}
    out = {
        "rollout/staleness_mean": sum(staleness_per_trajectory) / n,
        "rollout/staleness_max": float(max(staleness_per_trajectory)),
    }
    for s in range(bound + 1):
        out[f"rollout/staleness_hist/{s}"] = staleness_per_trajectory.count(s) / n
    return out


def _tagged(group: Group, version: int) -> Group:
    """`group` with each trajectory's `info["weights_version"]` set to the version that sampled it
    (anything else a test's `play` returns passes through)."""
    if not isinstance(group, Group):
        return group
    return dataclasses.replace(
        group,
        trajectories=tuple(
            dataclasses.replace(t, info={**t.info, "weights_version": version})
            for t in group.trajectories
        ),
    )


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
        # Hand-over (guarded by _cond): the producer's queued jobs (version, its weights), in order;
        # its finished rounds (version that sampled it, groups), in order; the exception that ended
        # it. `_in_flight` counts rounds asked for and not yet handed to the learner.
        self._requests: deque[tuple[int, Snapshot | None]] = deque()
        self._results: deque[tuple[int, list[Group]]] = deque()
        self._in_flight = 0
        self._error: BaseException | None = None
        self._busy = False
        # Producer side only: which version the copy holds.
        self._copy_version = 0
        # Metrics.
        self._dropped = 0
        self._step_wait_s = 0.0
        self._step_staleness: list[int] = []  # one entry per trajectory handed out this step
        self._last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------ learner
    def next_round(self) -> list[Group]:
        """The next round's groups, sampled by weights at most `max_staleness` publishes old, each
        trajectory tagged with that version (`info["weights_version"]`).

        Blocks until it is ready. A producer exception is re-raised here (the same exception, its
        traceback through `play`, with a note saying where it came from)."""
        if self._stop.is_set():
            raise RuntimeError("AsyncRollout.next_round after close()")
        self._start()
        started = time.perf_counter()
        with self._cond:
            if self._in_flight == 0:
                self._ask()  # nothing prefetched: the first round, or max_staleness 0
            while True:
                self._cond.wait_for(
                    lambda: bool(self._results) or self._error is not None or self._stop.is_set()
                )
                if self._error is not None:
                    raise self._error
                if not self._results:
                    raise RuntimeError("AsyncRollout closed while next_round was waiting")
                sampled_by, groups = self._results.popleft()
                self._in_flight -= 1
                staleness = self._version - sampled_by
                if staleness <= self.max_staleness:
                    break
                self._dropped += 1  # too old: sample it again with the newest weights
                self._ask()
            while self._in_flight < self.max_staleness:
                self._ask()  # the next rounds sample while the learner updates on this one
            self._step_wait_s += time.perf_counter() - started
            groups = [_tagged(g, sampled_by) for g in groups]
            trajectories = sum(len(g.trajectories) for g in groups if isinstance(g, Group))
            self._step_staleness += [staleness] * trajectories
            self._last_metrics = {
                "async/staleness": float(max(self._step_staleness, default=staleness)),
                "async/dropped_rounds": float(self._dropped),
                "async/wait_s": self._step_wait_s,
                "async/weights_version": float(sampled_by),
                **staleness_metrics(self._step_staleness, self.max_staleness),
            }
        return groups

    def publish(self, policy: Policy) -> None:
        """After an optimizer step: the next version's weights (a CPU clone of what trains). The
        producer loads them before the next round it is asked for, never mid-round."""
        snapshot = trainable_state(policy.model)  # cloned: the learner may now train on in place
        with self._cond:
            self._version += 1
            self._snapshot = snapshot
            # A step ends at a publish: wait time (summed) and staleness restart per step.
            self._step_wait_s = 0.0
            self._step_staleness = []

    @property
    def version(self) -> int:
        """Publishes so far (the learner's current weights version)."""
        return self._version

    @property
    def last_metrics(self) -> dict[str, float]:
        """For the round last returned: "async/staleness" (versions behind when consumed; the worst
        over the rounds returned since the last publish), "async/dropped_rounds" (cumulative),
        "async/wait_s" (learner time blocked in next_round since the last publish),
        "async/weights_version" (the version that sampled it), and over the trajectories returned
        since the last publish `staleness_metrics`. Empty before the first round."""
        with self._cond:
            return dict(self._last_metrics)

    def wait_idle(self) -> None:
        """Block until the producer is not sampling (a finished prefetched round stays queued for
        `next_round`). Call before reading state `play` mutates, e.g. the task sampler's state
        for a checkpoint, or `self.generator`'s RNG state. Re-raises a producer exception."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    (not self._busy and not self._requests)
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
        """Queue one round sampled by the current version (caller holds _cond). The snapshot
        travels with the request, so a publish before the producer reaches it cannot change it."""
        self._requests.append((self._version, self._snapshot))
        self._in_flight += 1
        self._cond.notify_all()

    # ----------------------------------------------------------------------------------- producer
    def _produce(self) -> None:
        playing = _StoppableGenerator(self.generator, self._stop)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._requests) or self._stop.is_set())
                if self._stop.is_set():
                    return
                version, snapshot = self._requests.popleft()
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
                self._results.append((version, groups))
                self._busy = False
                self._cond.notify_all()
