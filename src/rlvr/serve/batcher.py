"""Concurrent chat requests sampled together: one generator call for every request that is waiting.

An agent harness runs G x P conversations at once; served one at a time, each decode step would run
one row. The batcher collects the burst of requests that arrive together (and everything that queued
while the previous call ran) and samples all requests with the same model and sampling parameters in
one `generate` call (HFGenerator pads and batches them), so the server's
cost per step is close to that of the engine's own rollouts. A request with a `seed` runs alone, with
the generator's stream reseeded for it and restored after, so it neither shifts nor depends on others.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.serve.completions import use_model
from rlvr.serve.shared import seeded
from rlvr.serve.state import ServeState


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int | None
    model: str
    future: Future[list[Completion]] = field(default_factory=Future)


class GenerationBatcher:
    """`submit(prompt_ids, sampling, seed)` -> the request's n completions; a daemon thread samples."""

    def __init__(
        self,
        state: ServeState,
        gap_s: float = 0.05,
        max_wait_s: float = 0.5,
        max_prompts: int = 256,
    ) -> None:
        self.state = state
        self.gap_s = gap_s
        self.max_wait_s = max_wait_s
        self.max_prompts = max_prompts
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rlvr-serve-batcher", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        seed: int | None = None,
        model: str | None = None,
    ) -> list[Completion]:
        """The request's n completions, from `model` (a loaded LoRA adapter's name, or the base)."""
        request = _Request(prompt_ids, sampling, seed, model or self.state.model_name)
        self._queue.put(request)
        return request.future.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _take_batch(self, first: _Request) -> tuple[list[_Request], bool]:
        """`first` and the burst that follows it: requests keep joining while each arrives within
        `gap_s` of the previous one, for at most `max_wait_s` (agents started together send their
        turns within milliseconds; a lone request waits only `gap_s`). False when close() was asked.
        A decode step costs about the same for 1 row as for 30, so a small first batch would cost
        the others a whole extra generation."""
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_prompts:
            timeout = min(self.gap_s, deadline - time.monotonic())
            if timeout <= 0:
                break
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                break
            if item is None:
                return batch, False
            batch.append(item)
        return batch, True

    def _run(self) -> None:
        running = True
        while running:
            first = self._queue.get()
            if first is None:
                return
            batch, running = self._take_batch(first)
            # Same model, sampling parameters and no seed: one call. Seeded requests one by one.
            groups: dict[tuple[str, SamplingParams], list[_Request]] = {}
            for r in batch:
                if r.seed is None:
                    groups.setdefault((r.model, r.sampling), []).append(r)
            for (model, sampling), members in groups.items():
                self._sample(members, model, sampling, None)
            for r in batch:
                if r.seed is not None:
                    self._sample([r], r.model, r.sampling, r.seed)

    def _sample(
        self, members: list[_Request], model: str, sampling: SamplingParams, seed: int | None
    ) -> None:
        generator = self.state.generator
        try:
            with self.state.lock, use_model(self.state, model), seeded(generator, seed):
                results = generator.generate([r.prompt_ids for r in members], sampling)
        except Exception as exc:  # every waiting request learns why, none hangs
            for r in members:
                r.future.set_exception(exc)
            return
        for r, completions in zip(members, results, strict=True):
            r.future.set_result(completions)
