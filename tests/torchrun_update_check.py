"""One `policy_update` per scenario on a fixed batch: single process, or under torchrun with a DistContext.

    python -m torch.distributed.run --nproc_per_node 2 --standalone \
        tests/torchrun_update_check.py MODEL_DIR OUT_FILE ddp,fsdp [grpo,kl,lora]

Writes (rank 0) {"STRATEGY/SCENARIO": {"metrics": {...}, "params": {name: tensor}, "ref": [[...]] |
None}} to OUT_FILE with torch.save; every scenario starts from a freshly loaded policy, in one
process group. Then ppo's critic (`run_critic`, two scenarios) and a reference loaded late
(`run_late_reference`), each under its own key. tests/test_torchrun.py compares it with `run_scenario(..., dist=None)` in-process.

Each rank seeds its RNG differently before building the policy (1000 + rank; a single process is rank
0), so LoRA adapters start different on every rank and only `prepare_policy`'s broadcast makes the
distributed run match the single process.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from rlvr.build import build_optimizer, build_policy
from rlvr.config import RunConfig, load_config
from rlvr.records import Trajectory
from rlvr.scale.torch_dist import DistContext
from rlvr.train.companions import RunCritic, build_teacher
from rlvr.train.run_setup import ensure_reference
from rlvr.train.selection import Credit
from rlvr.train.update import policy_update, reference_logprobs

COMMON = [
    "model.bf16='off'",  # exact fp32 on every CPU
    "train.learning_rate=1e-3",
    "train.weight_decay=0.01",
    "sampling.max_new_tokens=16",
]
SCENARIOS: dict[str, list[str]] = {
    # Zero-advantage rows skipped: the ranks forward different numbers of micro-batches (fsdp pads).
    "grpo": ["train.micro_batch_size=7"],
    # KL in the loss against the frozen copy, two optimizer steps (pi_old forwards), an entropy bonus
    # (every row forwarded), per-sequence aggregation; a 1-token completion (fsdp: plain path).
    "kl": [
        "train.micro_batch_size=3",
        "objective.beta=0.1",
        "objective.num_iterations=2",
        "objective.entropy_coef=0.01",
        "objective.loss_aggregation=seq-mean-token-mean",
    ],
    # LoRA (fused log-probs by default), the KL in the reward: reference_logprobs sharded as well.
    "lora": [
        "train.micro_batch_size=5",
        "model.lora.enabled=true",
        "model.lora.r=4",
        "objective.beta=0.05",
        "objective.kl_in_reward=true",
    ],
    # distill's teacher (the base model: the KL is 0 on the first pass and pulls on the second),
    # sharded like the policy under fsdp, its forwards in step on every rank (padding included).
    "distill": [
        "train.micro_batch_size=3",
        "algorithm=distill",
        "distill.teacher={model}",
        "distill.reward_weight=0.5",
        "objective.num_iterations=2",
    ],
}
# ppo's critic (rlvr.train.companions.RunCritic): values, two updates (the head starts at 0, so only
# the second moves the backbone), values again. Full fine-tuning, and LoRA (adapters initialised
# differently on each rank, made equal by the broadcast).
CRITIC_SCENARIOS: dict[str, list[str]] = {
    "critic": ["algorithm=ppo", "train.micro_batch_size=3", "critic.learning_rate=1e-3"],
    "critic-lora": [
        "algorithm=ppo",
        "train.micro_batch_size=4",
        "critic.learning_rate=1e-3",
        "critic.lora.enabled=true",
        "critic.lora.r=4",
    ],
}


# Two AdamW steps turn float-rounding differences of near-zero gradient entries into visible weight
# differences (the second step's m / sqrt(v) can cancel); plain SGD with lr 1 makes the weight change
# the clipped gradient itself, which is what the distributed update must reproduce.
SGD_SCENARIOS = {"kl", "distill"}


def fixed_batch(one_token: bool) -> tuple[list[Trajectory], list[list[float]]]:
    """5 tasks x 4 samples, prompts of 3-9 tokens, completions of 2-13 tokens (one of 1 token when
    `one_token`); task "t2" is all-equal reward (A = 0, skipped rows), one row of "t4" has A = 0, one
    row of "t1" has a 3-token observation (policy_mask 0) in the middle of its completion."""
    gen = torch.Generator().manual_seed(7)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, 128, (n,), generator=gen).tolist())

    trajectories, advantages = [], []
    for task, prompt_len in enumerate((5, 9, 3, 7, 4)):
        prompt = ids(prompt_len)
        rewards = torch.randn(4, generator=gen)
        if task == 2:
            rewards = torch.ones(4)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        if task == 4:
            adv[1] = 0.0
        for k in range(4):
            n = int(torch.randint(2, 14, (1,), generator=gen))
            if one_token and task == 3 and k == 0:
                n = 1
            mask = [1] * n
            if task == 1 and k == 2 and n >= 6:
                mask[2:5] = [0, 0, 0]
            behaviour = [-float(torch.rand(1, generator=gen)) * m for m in mask]
            trajectories.append(
                Trajectory(
                    task_id=f"t{task}",
                    token_ids=prompt + ids(n),
                    policy_mask=(0,) * prompt_len + tuple(mask),
                    logprobs=(0.0,) * prompt_len + tuple(behaviour),
                    prompt_length=prompt_len,
                    completion_text="",
                    finish_reason="stop",
                )
            )
            advantages.append([float(adv[k]) * m for m in mask])
    return trajectories, advantages


def uses_one_token_row(name: str) -> bool:
    return name == "kl"


def config(model_dir: str, overrides: list[str]) -> RunConfig:
    filled = [o.replace("{model}", model_dir) for o in overrides]
    return load_config(None, [f"model.name={model_dir}", *COMMON, *filled])


def is_sharded(model: Any) -> bool:
    """Whether `model`'s weights are fsdp shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def run_scenario(
    model_dir: str, name: str, dist: DistContext | None, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """Load the policy, shard it (`dist`), one reference_logprobs and one policy_update; the metrics,
    the updated weights (all of them, unsharded) and the reference log-probs (None unless in reward)."""
    cfg = config(model_dir, [*SCENARIOS[name], *extra])
    torch.manual_seed(1000 + (dist.rank if dist is not None else 0))
    policy = build_policy(cfg)
    if dist is not None:
        dist.prepare_policy(policy)
    # After prepare_policy: under fsdp the optimizer must hold the sharded parameters.
    optimizer: torch.optim.Optimizer
    if name in SGD_SCENARIOS:
        optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=1.0)
    else:
        optimizer, _ = build_optimizer(policy, cfg)  # fused AdamW, as training runs
    teacher = None
    if cfg.algorithm == "distill":
        teacher = build_teacher(cfg, policy)
        if dist is not None:
            dist.prepare_model(teacher)
    trajectories, advantages = fixed_batch(one_token=uses_one_token_row(name))
    ref = reference_logprobs(policy, trajectories, cfg, dist)
    teacher_sharded = teacher is not None and is_sharded(teacher)
    metrics = policy_update(
        policy, optimizer, trajectories, advantages, cfg, teacher=teacher, dist=dist
    )
    if dist is not None:
        params = dist.full_state_dict(policy.model)
    else:
        params = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    return {
        "metrics": metrics,
        "params": {k: v.clone() for k, v in params.items()},
        "ref": ref,
        "teacher_sharded": teacher_sharded,
        # and it gives back what it gathered after each forward (rlvr.scale.torch_dist.reshard)
        "teacher_sharded_after": teacher is not None and is_sharded(teacher),
    }


def run_critic(model_dir: str, name: str, dist: DistContext | None) -> dict[str, Any]:
    """A critic built as a run builds it, then values -> update -> update -> values on the fixed batch
    (returns: the advantages plus 1, old values: the first values); the metrics of both updates, the
    values and the trained parameters (whole)."""
    cfg = config(model_dir, CRITIC_SCENARIOS[name])
    torch.manual_seed(1000 + (dist.rank if dist is not None else 0))
    critic = RunCritic(cfg, pad_token_id=0, device=torch.device("cpu"), dist=dist)
    trajectories, advantages = fixed_batch(one_token=False)
    returns = [[a + 1.0 for a in row] for row in advantages]
    before = critic.token_values(trajectories)
    credit = Credit(token_advantages=advantages, returns=returns, old_values=before)
    first = critic.update(trajectories, credit)
    second = critic.update(trajectories, credit)
    return {
        "metrics": {**{f"first/{k}": v for k, v in first.items()}, **second},
        "values": critic.token_values(trajectories),
        "params": critic.model.full_trainable_state(),
        "sharded": is_sharded(critic.model),
    }


def run_late_reference(model_dir: str, dist: DistContext | None) -> dict[str, Any]:
    """A full fine-tuning run that starts at beta 0 and gets its reference later (a mitigation
    raised beta: rlvr.train.run_setup.ensure_reference), scored with the KL in the reward."""
    cfg = config(model_dir, ["train.micro_batch_size=3"])
    torch.manual_seed(1000 + (dist.rank if dist is not None else 0))
    policy = build_policy(cfg)
    if dist is not None:
        dist.prepare_policy(policy)
    raised = config(
        model_dir,
        ["train.micro_batch_size=3", "objective.beta=0.1", "objective.kl_in_reward=true"],
    )
    ensure_reference(policy, raised, dist)
    trajectories, _ = fixed_batch(one_token=False)
    assert policy._reference is not None
    return {
        "ref": reference_logprobs(policy, trajectories, raised, dist),
        "sharded": is_sharded(policy._reference),
    }


def main() -> None:
    model_dir, out_file, strategies = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else list(SCENARIOS)
    context = DistContext.from_env("ddp")
    if context is None:
        raise SystemExit("run me under torchrun (WORLD_SIZE > 1)")
    results = {}
    for strategy in strategies:
        assert strategy in ("ddp", "fsdp"), strategy
        dist = replace(context, strategy=strategy)
        for name in names:
            results[f"{strategy}/{name}"] = run_scenario(model_dir, name, dist)
        for name in CRITIC_SCENARIOS:
            results[f"{strategy}/{name}"] = run_critic(model_dir, name, dist)
        results[f"{strategy}/late-reference"] = run_late_reference(model_dir, dist)
    if context.is_main:
        torch.save(results, out_file)
    context.barrier()
    context.close()


if __name__ == "__main__":
    main()
