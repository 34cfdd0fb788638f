"""Ray rollout workers (rlvr.scale.ray_rollout) on a local 2-CPU Ray cluster and the tiny model.

Skipped where Ray is not installed (it is the `scale` extra). Workers reserve half a CPU each so a
test's extra RayRollout fits next to the module's two workers on a 2-core machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from rlvr.build import build_policy, rollout_limits  # noqa: E402
from rlvr.config import RunConfig  # noqa: E402
from rlvr.models import Policy  # noqa: E402
from rlvr.records import Task, flatten  # noqa: E402
from rlvr.rollout.generator import SamplingParams  # noqa: E402
from rlvr.scale.ray_rollout import RayRollout, chunk_bounds  # noqa: E402
from rlvr.train.batch import collate, token_logprobs  # noqa: E402
from rlvr.train.sources import Sources  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def make_cfg(model_dir: Path, workers: int = 2, lora: bool = False, **extra: Any) -> RunConfig:
    data: dict[str, Any] = {
        # fp32 sampling, so the workers' behaviour log-probs compare to the learner's at 1e-4
        "model": {"name": str(model_dir), "bf16": "off", "lora": {"enabled": lora, "r": 4}},
        "task": {"source": "arithmetic", "arithmetic": {"digits": 1}},
        "rewards": [
            {"fn": f"{EXAMPLES / 'tiny_rewards.py'}:digit_fraction", "name": "digits"},
            {"fn": "numeric_match", "name": "correct", "weight": 0.0},
        ],
        "sampling": {"group_size": 3, "prompts_per_step": 5, "max_new_tokens": 6},
        "distributed": {"ray": True, "rollout_workers": workers, "worker_cpus": 0.5},
        "tracking": {"trackio": False},
        **extra,
    }
    return RunConfig.model_validate(data)


def sampling_of(cfg: RunConfig) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(
        n=s.group_size, temperature=s.temperature, max_new_tokens=s.max_new_tokens
    )


def batch_tasks(cfg: RunConfig) -> list[Task]:
    return Sources(cfg).next_batch(cfg.sampling.prompts_per_step)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def two_workers(local_ray: None, tiny_model_dir: Path) -> Iterator[tuple[RayRollout, RunConfig]]:
    cfg = make_cfg(tiny_model_dir)
    rollout = RayRollout(cfg)
    yield rollout, cfg
    rollout.close()


def max_logprob_gap(policy: Policy, cfg: RunConfig, groups: list[Any]) -> float:
    """Largest |worker behaviour log-prob - learner's recomputed log-prob| over sampled tokens."""
    trajs = flatten(groups)
    zeros = [[0.0] * (len(t.token_ids) - t.prompt_length) for t in trajs]
    batch = collate(trajs, zeros, int(policy.tokenizer.pad_token_id))
    with torch.no_grad():
        learner, _ = token_logprobs(policy.model, batch, cfg.sampling.temperature)
    sampled = batch.mask_B_C.bool()
    return float((learner - batch.behaviour_logprobs_B_C).abs()[sampled].max())


def test_chunks_are_contiguous_and_balanced() -> None:
    assert chunk_bounds(5, 2) == [(0, 3), (3, 5)]
    assert chunk_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]


def test_rollout_returns_scored_groups_in_task_order(two_workers: Any) -> None:
    rollout, cfg = two_workers
    tasks = batch_tasks(cfg)
    sampling = sampling_of(cfg)
    groups = rollout.rollout(tasks, sampling, rollout_limits(cfg))
    assert [g.task.id for g in groups] == [t.id for t in tasks]
    for group, task in zip(groups, tasks, strict=True):
        assert len(group.trajectories) == sampling.n
        for traj in group.trajectories:
            assert traj.task_id == task.id
            assert set(traj.rewards) == {"digits", "correct"} and not traj.reward_errors
    metrics = rollout.last_metrics
    # 5 tasks over 2 workers: both were busy (chunks of 3 and 2)
    assert 0 < metrics["rollout_workers/busy_min_s"] <= metrics["rollout_workers/busy_max_s"]


def perturbed(policy: Policy, scale: float) -> Policy:
    """The policy with fixed-seed noise added to every trainable weight (a stand-in for updates)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return policy


def check_sync(rollout: RayRollout, cfg: RunConfig, policy: Policy) -> None:
    tasks, sampling, limits = batch_tasks(cfg), sampling_of(cfg), rollout_limits(cfg)
    before = max_logprob_gap(policy, cfg, rollout.rollout(tasks, sampling, limits))
    rollout.sync_weights(policy)
    after = max_logprob_gap(policy, cfg, rollout.rollout(tasks, sampling, limits))
    assert before > 0.1, before  # the workers still sampled from the base weights
    assert after < 1e-4, after


def test_weight_sync_makes_workers_sample_the_learner_policy(two_workers: Any) -> None:
    rollout, cfg = two_workers
    policy = perturbed(build_policy(cfg), 0.2)
    check_sync(rollout, cfg, policy)
    # HF's fp32 forward samples in the workers: every weight is sent in fp32.
    assert rollout.sync_dtype is None
    fp32_bytes = sum(p.numel() * 4 for p in policy.trainable_parameters())
    assert rollout.last_metrics["sync/weight_bytes"] == fp32_bytes


def test_weight_sync_with_lora(local_ray: None, tiny_model_dir: Path) -> None:
    cfg = make_cfg(tiny_model_dir, workers=1, lora=True)
    policy = build_policy(cfg)
    assert policy.lora
    with RayRollout(cfg) as rollout:
        check_sync(rollout, cfg, perturbed(policy, 0.3))  # only the adapters move


def test_an_error_raised_in_a_worker_names_the_worker(two_workers: Any) -> None:
    rollout, cfg = two_workers
    tasks = batch_tasks(cfg)
    # the second chunk (worker 1) holds a task of a source the workers do not know
    tasks[-1] = Task(id="stray", messages=tasks[-1].messages, source="nowhere")
    with pytest.raises(RuntimeError, match=r"^rollout worker 1 failed during a rollout: KeyError"):
        rollout.rollout(tasks, sampling_of(cfg), rollout_limits(cfg))


def test_a_worker_that_cannot_start_names_the_worker_and_cause(
    local_ray: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "broken.py").write_text("raise ImportError('broken on purpose')\n")
    cfg = make_cfg(tiny_model_dir, workers=1, rewards=[{"fn": f"{tmp_path / 'broken.py'}:fn"}])
    with pytest.raises(
        RuntimeError, match=r"^rollout worker 0 failed to start: ConfigError"
    ) as err:
        RayRollout(cfg)
    assert "broken on purpose" in str(err.value) and "\n" not in str(err.value)


# Last in the file on purpose: it kills one of the module's workers.
def test_the_loop_trains_with_ray_workers_and_resumes(
    local_ray: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`distributed.ray: true` through train(): the workers play every round, get the weights after
    every update (their behaviour log-probs equal the learner's), and after a resume start from the
    checkpoint's weights, not the base model's."""
    import json

    from rlvr.train.loop import train

    run_dir = tmp_path / "run"
    cfg = make_cfg(
        tiny_model_dir,
        output_dir=str(run_dir),
        train={"steps": 3, "learning_rate": 3e-3},
        eval={"at_start": False, "at_end": False},
        checkpoint={"every": 2},
    ).model_copy(
        update={
            "tracking": make_cfg(tiny_model_dir).tracking.model_copy(update={"progress": False})
        }
    )
    train(cfg)
    resumed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 4})})
    train(resumed, resume=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # step 4 after resuming from step 3
    assert all(r["update/behaviour_logprob_abs_diff"] < 1e-4 for r in steps)
    assert all(r["rollout_workers/busy_min_s"] > 0 for r in steps)  # both workers played


def test_a_killed_worker_is_reported_not_waited_for(two_workers: Any) -> None:
    rollout, cfg = two_workers
    ray.kill(rollout._workers[1])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rollout worker 1 failed during a rollout: Actor"):
        rollout.rollout(batch_tasks(cfg), sampling_of(cfg), rollout_limits(cfg))
    assert time.monotonic() - started < 30


def test_workers_sampling_from_a_bf16_copy_get_bf16_weights(
    local_ray: None, tiny_model_dir: Path
) -> None:
    """Full fine-tuning, actors on rlvr's decode path from a bf16 copy: the sync sends the linear
    weights in bf16 (fewer bytes than the fp32 sync of the module's workers) and logs it."""
    cfg = make_cfg(
        tiny_model_dir, workers=1, generator={"decode": "fast", "decode_dtype": "bfloat16"}
    )
    policy = perturbed(build_policy(cfg), 0.2)
    with RayRollout(cfg) as rollout:
        assert rollout.sync_dtype == torch.bfloat16
        rollout.sync_weights(policy)
        sent = rollout.last_metrics["sync/weight_bytes"]
    fp32_bytes = sum(p.numel() * 4 for p in policy.trainable_parameters())
    assert sent < 0.8 * fp32_bytes
    assert rollout.last_metrics["sync/weight_seconds"] > 0
