"""Single-turn rollouts: render each task's chat prompt once, sample G completions, score them.

The trajectory's tokens are the rendered prompt's ids followed by the sampled ids, exactly as sampled;
the text handed to verifiers is decoded from those ids, never the other way round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rlvr.records import Group, Span, Task, Trajectory
from rlvr.rollout.generator import Generator, SamplingParams
from rlvr.verifiers import Rubric


def render_prompt(tokenizer: Any, task: Task) -> list[int]:
    """Token ids of the task's messages under the model's chat template, ready for the assistant turn."""
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    if task.tools:
        kwargs["tools"] = list(task.tools)
    ids = tokenizer.apply_chat_template([dict(m) for m in task.messages], **kwargs)
    return [int(i) for i in ids]


def sample_trajectories(
    tasks: Sequence[Task], generator: Generator, tokenizer: Any, sampling: SamplingParams
) -> list[list[Trajectory]]:
    """(P, G) unscored trajectories: sampled tokens appended to each rendered prompt."""
    prompts = [render_prompt(tokenizer, t) for t in tasks]
    completions = generator.generate(prompts, sampling)
    out: list[list[Trajectory]] = []
    for task, prompt, group in zip(tasks, prompts, completions, strict=True):
        trajectories = []
        for c in group:
            n_prompt, n_new = len(prompt), len(c.token_ids)
            trajectories.append(
                Trajectory(
                    task_id=task.id,
                    token_ids=tuple(prompt) + c.token_ids,
                    policy_mask=(0,) * n_prompt + (1,) * n_new,
                    logprobs=(0.0,) * n_prompt + c.logprobs,
                    prompt_length=n_prompt,
                    completion_text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                    finish_reason=c.finish_reason,
                    turns=(Span(n_prompt, n_prompt + n_new),),
                )
            )
        out.append(trajectories)
    return out


def score_trajectory(trajectory: Trajectory, task: Task, rubric: Rubric) -> Trajectory:
    score = rubric.score(trajectory, task)
    return dataclasses.replace(
        trajectory,
        rewards=dict(score.rewards),
        reward=score.total if score.ok else 0.0,
        reward_errors=tuple(sorted(score.errors)),
        info={**trajectory.info, "reward_errors": dict(score.errors)}
        if score.errors
        else trajectory.info,
    )


def rollout_groups(
    tasks: Sequence[Task],
    generator: Generator,
    tokenizer: Any,
    sampling: SamplingParams,
    rubric: Rubric,
) -> list[Group]:
    """Sample `sampling.n` trajectories per task and score each with the rubric."""
    sampled = sample_trajectories(tasks, generator, tokenizer, sampling)
    return [
        Group(task=task, trajectories=tuple(score_trajectory(t, task, rubric) for t in trajs))
        for task, trajs in zip(tasks, sampled, strict=True)
    ]
