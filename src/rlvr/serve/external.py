"""`rollout: external`: the user's agent plays the episodes through the OpenAI API; rlvr trains on
what the endpoint recorded (OpenPipe ART's model: the trainer goes under existing agent code).

Each step, for every task and each of its G samples, the agent function is called in a worker thread
as `agent(base_url=, model=, task=, rollout_id=)` (it may take any subset of these keywords). It talks
to the in-run server (serve/app.py) with any OpenAI client, passing `rollout_id` (e.g.
`metadata={"rollout_id": rollout_id}`), and returns None, a reward, or a dict of named reward parts.
Or `external.command` names a program (any language) run once per rollout with OPENAI_BASE_URL and
OPENAI_API_KEY=rlvr-rollout-<id> in its environment: an agent that builds its client from those
variables is recorded with no change at all.
The server samples from the policy being trained, under the run's temperature, and records every
exchange token for token; when all agents of the step have returned, each rollout's recording becomes
one `Trajectory` (its policy tokens, behaviour log-probs, observation tokens masked) scored by the
run's rubric (`rewards:`) plus the parts the agent returned. Then the usual update runs; the next
step's requests already see the new weights (the server holds the same model object).

A rollout whose agent raised, timed out, or sent no request under its id is kept out of the update and
counted, like a failing reward function (train.max_reward_error_fraction). An agent that rewrote its
conversation mid-rollout left several segments (serve/recorder.py); its last segment is trained (it
holds the final answer) and `external/rewritten_histories` counts such rollouts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import shlex
import statistics
import subprocess
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Protocol

from rlvr.config import RunConfig
from rlvr.models import Policy
from rlvr.records import FinishReason, Group, Span, Task, Trajectory
from rlvr.rollout.engine import Scoring
from rlvr.rollout.hf import HFGenerator
from rlvr.serve.app import ROLLOUT_KEY_PREFIX, create_app
from rlvr.serve.recorder import RecordedRollout, Recorder
from rlvr.serve.runner import BackgroundServer, serve_state
from rlvr.verifiers.rubric import Prefetched, resolve_callable

SERVED_MODEL_NAME = "policy"

AgentFn = Callable[..., Any]


def resolve_agent(spec: str, base_dir: Path | None) -> AgentFn:
    fn: AgentFn = resolve_callable(spec, base_dir, "external.agent")
    return fn


def _call_agent(agent: AgentFn, **kwargs: Any) -> Any:
    try:
        params = inspect.signature(agent).parameters
    except (TypeError, ValueError):
        return agent(**kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return agent(**kwargs)
    return agent(**{k: v for k, v in kwargs.items() if k in params})


def command_agent(command: str | list[str], cwd: Path | None, timeout_s: float) -> AgentFn:
    """`external.command` as an agent function: the program runs once per rollout with the endpoint,
    its rollout id and the task in its environment (see ExternalConfig.command); returns its reward
    parts (the last stdout line, when JSON) or None. A non-zero exit raises with its stderr's end."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)

    def run(base_url: str, model: str, task: Task, rollout_id: str) -> Any:
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": f"{ROLLOUT_KEY_PREFIX}{rollout_id}",
            "RLVR_ROLLOUT_ID": rollout_id,
            "RLVR_MODEL": model,
            "RLVR_TASK": json.dumps(
                {"id": task.id, "messages": list(task.messages), "fields": dict(task.fields)},
                default=str,
            ),
        }
        done = subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            tail = " ".join(done.stderr.strip().splitlines()[-3:])[-300:]
            raise RuntimeError(f"{argv[0]} exited with {done.returncode}: {tail}")
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            return None  # the program printed no reward: the rubric alone scores

    return run


def agent_parts(result: Any) -> dict[str, float]:
    """The agent's returned reward parts: None -> {}, a number -> {"agent": x}, a dict as given."""
    if result is None:
        return {}
    if isinstance(result, bool) or not isinstance(result, (int, float, dict)):
        raise TypeError(
            f"the agent returned {type(result).__name__}; expected None, a number or a dict"
        )
    items = {"agent": result} if not isinstance(result, dict) else result
    parts = {}
    for name, value in items.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(
                f"reward part {name!r} from the agent is {value!r}, not a finite number"
            )
        parts[str(name)] = float(value)
    return parts


def trajectory_from_recording(task: Task, rollout: RecordedRollout, tokenizer: Any) -> Trajectory:
    """The last segment of a recorded rollout as an unscored Trajectory."""
    seg = rollout.segments[-1]
    last_reply: dict[str, Any] = next(
        (m for m in reversed(seg.messages) if m.get("role") == "assistant"), {}
    )
    finish: FinishReason = (
        "length" if seg.finish_reasons and seg.finish_reasons[-1] == "length" else "stop"
    )
    return Trajectory(
        task_id=task.id,
        token_ids=tuple(seg.token_ids),
        policy_mask=tuple(seg.policy_mask),
        logprobs=tuple(seg.logprobs),
        prompt_length=seg.prompt_length,
        completion_text=str(last_reply.get("content") or ""),
        finish_reason=finish,
        turns=tuple(Span(s.start, s.end) for s in seg.turns),
        messages=tuple(seg.messages),
        source=task.source,
        info={
            "num_turns": len(seg.turns),
            "segments": len(rollout.segments),
            "requests": rollout.requests,
        },
    )


def failed_trajectory(task: Task, tokenizer: Any, why: str) -> Trajectory:
    """A placeholder for a rollout that produced nothing trainable; excluded from the update."""
    from rlvr.rollout.chat import render_prompt_ids

    ids = render_prompt_ids(tokenizer, [dict(m) for m in task.messages])
    return Trajectory(
        task_id=task.id,
        token_ids=tuple(ids),
        policy_mask=(0,) * len(ids),
        logprobs=(0.0,) * len(ids),
        prompt_length=len(ids),
        completion_text="",
        finish_reason="error",
        reward_errors=("agent",),
        info={"reward_errors": {"agent": why[:500]}, "num_turns": 0},
        source=task.source,
    )


class TaskScoring(Protocol):
    """How each task is scored: the trainer's `Sources` (rlvr.train.sources) is one. A protocol, so
    that this server does not import the trainer (tests/test_layers.py)."""

    def scoring(self, task: Task) -> Scoring: ...


class ExternalRollout:
    """The in-run endpoint and the agent calls; `rollout(tasks, g)` -> (P, g) scored groups."""

    def __init__(
        self,
        cfg: RunConfig,
        policy: Policy,
        generator: HFGenerator,
        sources: TaskScoring,
        config_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.sources = sources
        self.tokenizer = policy.tokenizer
        ext = cfg.external
        if ext.command is not None:
            self.agent = command_agent(ext.command, config_dir, ext.timeout_s)
        else:
            assert ext.agent is not None
            self.agent = resolve_agent(ext.agent, config_dir)
        self.recorder = Recorder()
        state = serve_state(policy, SERVED_MODEL_NAME, generator=generator)
        state.recorder = self.recorder
        state.required_temperature = cfg.sampling.temperature
        state.max_tokens_cap = cfg.sampling.max_new_tokens
        self.state = state
        self.server = BackgroundServer(create_app(state), host=ext.host, port=ext.port).start()
        self.pool = ThreadPoolExecutor(ext.concurrency, thread_name_prefix="rlvr-agent")
        self.step = 0
        self.last_metrics: dict[str, float] = {}

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def _play(self, tasks: Sequence[Task], g: int, tag: str) -> list[list[tuple[Any, str]]]:
        """Run the agent g times per task; per rollout (its result or exception, its id)."""
        ids = [
            [f"{tag}-{i}-{j}-{uuid.uuid4().hex[:8]}" for j in range(g)] for i in range(len(tasks))
        ]
        futures = [
            [
                self.pool.submit(
                    _call_agent,
                    self.agent,
                    base_url=self.base_url,
                    model=SERVED_MODEL_NAME,
                    task=task,
                    rollout_id=rid,
                )
                for rid in row
            ]
            for task, row in zip(tasks, ids, strict=True)
        ]
        out: list[list[tuple[Any, str]]] = []
        for row_futures, row_ids in zip(futures, ids, strict=True):
            row = []
            for future, rid in zip(row_futures, row_ids, strict=True):
                try:
                    row.append((future.result(timeout=self.cfg.external.timeout_s), rid))
                except FutureTimeout:
                    row.append(
                        (
                            TimeoutError(
                                f"ran past external.timeout_s={self.cfg.external.timeout_s:g}"
                            ),
                            rid,
                        )
                    )
                except Exception as exc:  # the agent's own failure: reported, never a reward of 0
                    row.append((exc, rid))
            out.append(row)
        return out

    def _recorded(
        self, task: Task, result: Any, rid: str
    ) -> Trajectory | tuple[Trajectory, dict[str, float]]:
        """The rollout's unscored trajectory and the agent's reward parts, or a failed trajectory."""
        recording = self.recorder.pop(rid)
        if isinstance(result, BaseException):
            return failed_trajectory(
                task, self.tokenizer, f"agent raised {type(result).__name__}: {result}"
            )
        if recording is None or not recording.segments or not recording.segments[-1].turns:
            return failed_trajectory(
                task, self.tokenizer, f"the agent sent no request under rollout id '{rid}'"
            )
        try:
            parts = agent_parts(result)
        except (TypeError, ValueError) as err:
            return failed_trajectory(task, self.tokenizer, str(err))
        return trajectory_from_recording(task, recording, self.tokenizer), parts

    def _score_all(self, played: Sequence[tuple[Task, Any, str]]) -> list[Trajectory]:
        """Score every played rollout: the agent's parts + the run's rubric. Slow, thread-safe rubric
        functions (`@parallel_reward`, e.g. code execution) run across all rollouts at once, as in
        the engine (rollout_groups)."""
        recorded = [self._recorded(task, result, rid) for task, result, rid in played]
        prefetched: Prefetched = {}
        rubrics = {id(r): r for task, *_ in played if (r := self.sources.scoring(task).rubric)}
        for rubric in rubrics.values():
            pairs = [
                (rec[0], task)
                for (task, *_), rec in zip(played, recorded, strict=True)
                if isinstance(rec, tuple) and self.sources.scoring(task).rubric is rubric
            ]
            prefetched.update(rubric.prefetch(pairs, workers=self.cfg.rollout.env_workers))
        out = []
        for (task, *_), rec in zip(played, recorded, strict=True):
            if not isinstance(rec, tuple):
                out.append(rec)
                continue
            trajectory, parts = rec
            scoring = self.sources.scoring(task)
            rewards = dict(parts)
            total = sum(scoring.env_weights.get(n, 1.0) * v for n, v in parts.items())
            errors: dict[str, str] = {}
            if scoring.rubric is not None:
                score = scoring.rubric.score(trajectory, task, prefetched)
                rewards.update(score.rewards)
                errors.update(score.errors)
                total += score.total
            info = dict(trajectory.info)
            if scoring.rubric is not None and score.skipped and not rewards and not errors:
                info["unscorable"] = list(score.skipped)  # every TRL-style function said None
            if errors:
                info["reward_errors"] = errors
            turns = len(trajectory.turns)
            out.append(
                dataclasses.replace(
                    trajectory,
                    rewards=rewards,
                    reward=total if not errors else 0.0,
                    reward_errors=tuple(sorted(errors)),
                    # The whole reward on the last turn, as the engine puts a rubric's share.
                    turn_rewards=(0.0,) * (turns - 1) + (total,) if turns else (),
                    info=info,
                )
            )
        return out

    def rollout(self, tasks: Sequence[Task], g: int) -> list[Group]:
        self.step += 1
        played = self._play(tasks, g, f"step{self.step}")
        scored = iter(
            self._score_all(
                [
                    (task, res, rid)
                    for task, row in zip(tasks, played, strict=True)
                    for res, rid in row
                ]
            )
        )
        groups = [
            Group(task=task, trajectories=tuple(next(scored) for _ in range(g))) for task in tasks
        ]
        flat = [t for grp in groups for t in grp.trajectories]
        self.last_metrics = {
            "external/agent_errors": float(sum("agent" in t.reward_errors for t in flat)),
            "external/rewritten_histories": float(sum(t.info.get("segments", 1) > 1 for t in flat)),
            "external/requests_per_rollout": statistics.fmean(
                float(t.info.get("requests", 0)) for t in flat
            ),
        }
        return groups

    def evaluate(self, tasks: Sequence[Task], metric: str) -> dict[str, float]:
        """The agent once on each held-out task: eval/accuracy (the `metric` component), eval/reward,
        and each component's mean. Greedy, like the engine's eval (pass@1), unless the agent asks
        for a temperature: the training lock on the temperature is lifted meanwhile."""
        state = self.state
        required, default = state.required_temperature, state.default_temperature
        state.required_temperature, state.default_temperature = None, 0.0
        try:
            played = self._play(tasks, 1, f"eval{self.step}")
        finally:
            state.required_temperature, state.default_temperature = required, default
        scored = self._score_all([(task, *row[0]) for task, row in zip(tasks, played, strict=True)])
        usable = [t for t in scored if t.usable]
        out: dict[str, float] = {
            "eval/n": float(len(scored)),
            "eval/errors": float(len(scored) - len(usable)),
        }
        if not usable:
            return {**out, "eval/accuracy": float("nan"), "eval/reward": float("nan")}
        names = sorted({n for t in usable for n in t.rewards})
        for name in names:
            out[f"eval/{name}"] = statistics.fmean(t.rewards.get(name, 0.0) for t in usable)
        out["eval/reward"] = statistics.fmean(t.reward for t in usable)
        out["eval/accuracy"] = out.get(f"eval/{metric}", out["eval/reward"])
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server.stop()
