"""Between rollout and update: which groups are learned from, and the advantage of every token.

`collect_groups` applies the group filter (StarPO-S variance filtering, DAPO zero-variance drop and
dynamic sampling; rlvr.algorithms.filtering) and `assign_credit` turns rewards into per-token
advantages as `objective.credit` says (rlvr.algorithms.credit). Both are thin: the rules themselves
are pure functions with hand-worked tests.

History windows (`rollout.history: window`): the update trains on one row per turn
(`Trajectory.turn_samples`: the windowed prompt the turn was sampled from + its sampled tokens,
the opening as the row's prompt, shared by every row of a task, the kept turns masked), so
`collect_groups` hands over each kept episode as its turn rows, and `assign_credit` lifts the rows
back to their episodes, computes the credit there exactly as for full history (group statistics over
episodes: a 10-turn episode counts once in its group's mean and std, not 10 times; turn returns and
GiGPO's anchor states from the episode's turns), and gives each row its turn's slice. The loss then
aggregates over rows as configured (`objective.loss_aggregation`): the default token mean over the
batch weighs every sampled token once, as with full history; the per-sequence means (TRL's "grpo"
aggregation) average per turn sample, so a long episode weighs more there than with full history.

Both run on the host (`HOST`): rewards, log-probs and masks arrive as Python numbers and leave as
Python lists, a few floats per token; a GPU would add a launch and a wait per operation. The update
puts the advantages on the model's device with the rest of the batch (rlvr.train.batch.collate).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rlvr.algorithms import KL_ESTIMATORS, AdvantageBatch, Algorithm, group_reward_std, zero_outside
from rlvr.algorithms.credit import (
    anchor_group_metrics,
    gigpo_step_advantages,
    token_advantages,
    turn_advantages,
    turn_state_keys,
)
from rlvr.algorithms.filtering import select_groups
from rlvr.algorithms.gae import (
    gae_advantages,
    reinforce_pp_returns,
    token_level_rewards,
    turn_reward_positions,
    whiten,
)
from rlvr.algorithms.placebo import partner_turn_rewards, placebo_partners
from rlvr.algorithms.shaping import soft_overlong_penalty
from rlvr.config import RunConfig
from rlvr.records import Group, Trajectory, flatten
from rlvr.registry import ALGORITHMS

HOST = torch.device("cpu")  # where credit assignment computes (module docstring)


def collect_groups(
    cfg: RunConfig, sample_round: Callable[[], list[Group]]
) -> tuple[list[Group], list[Group], dict[str, float]]:
    """Sample rounds of groups and keep those the filter selects; returns (sampled, kept, metrics).

    Without dynamic sampling one round is drawn and filtered. With it (DAPO), rounds continue until
    prompts_per_step groups were kept or max_sampling_rounds is reached; at most prompts_per_step
    groups are kept. Metrics describe every sampled group, so the filter cannot hide a collapse.
    `sampled` holds episodes; `kept` holds what the update trains on (`training_group`): the
    episodes, or with a history window each episode's turn rows.
    """
    f, group_size = cfg.filter, cfg.sampling.group_size
    sampled: list[Group] = []
    kept: list[Group] = []
    stds: list[float] = []  # in-group reward std of every sampled group
    kept_stds: list[float] = []
    rounds = 0
    while True:
        rounds += 1
        groups = sample_round()
        sampled.extend(groups)
        trajs = flatten(groups)
        std_P = group_reward_std(
            torch.tensor([t.reward for t in trajs], device=HOST),
            torch.tensor([t.usable for t in trajs], device=HOST),
            group_size,
        ).tolist()
        stds.extend(std_P)
        keep = select_groups(std_P, f.group_filter, f.top_p, f.top_k_fraction, f.drop_zero_std)
        kept.extend(groups[i] for i in keep)
        kept_stds.extend(std_P[i] for i in keep)
        if not f.dynamic_sampling or len(kept) >= cfg.sampling.prompts_per_step:
            break
        if rounds >= f.max_sampling_rounds:
            break
    if f.dynamic_sampling:
        kept = kept[: cfg.sampling.prompts_per_step]
        kept_stds = kept_stds[: cfg.sampling.prompts_per_step]
    kept = [training_group(g) for g in kept]
    metrics = {
        "rollout/in_group_std": sum(stds) / len(stds),
        "rollout/filter_kept_ratio": len(kept) / len(sampled),
        "rollout/sampling_rounds": float(rounds),
        # Of the groups the update trains on, the share with all-equal rewards (advantage 0).
        "signal/kept_groups": float(len(kept)),
        "signal/kept_all_equal_frac": (
            sum(s == 0 for s in kept_stds) / len(kept_stds) if kept_stds else 1.0
        ),
    }
    return sampled, kept, metrics


def training_group(group: Group) -> Group:
    """The group as training rows: an episode sampled with a history window becomes its per-turn
    samples (`Trajectory.turn_samples`, in turn order, episodes in group order); any other episode
    (full history, or one that never sampled a turn) stays one row."""
    if not any(t.history_starts for t in group.trajectories):
        return group
    rows = [row for t in group.trajectories for row in (t.turn_samples() or (t,))]
    return Group(task=group.task, trajectories=tuple(rows))


@dataclass
class Credit:
    """What the update needs from credit assignment: per-token advantages (one list per trajectory,
    one value per completion token) and, for ppo, the critic's targets and its old values."""

    token_advantages: list[list[float]]
    returns: list[list[float]] | None = None
    old_values: list[list[float]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def _padded(rows: Sequence[Sequence[float]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [[float(v) for v in row] + [0.0] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.float32, device=HOST).reshape(len(rows), width)


def _unpadded(tensor_B_T: torch.Tensor, rows: Sequence[Sequence[float]]) -> list[list[float]]:
    return [tensor_B_T[i, : len(r)].tolist() for i, r in enumerate(rows)]


def assign_credit(
    trajectories: Sequence[Trajectory],
    cfg: RunConfig,
    algorithm: Algorithm | str | None = None,
    *,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    values: Sequence[Sequence[float]] | None = None,
    step: int = 0,
) -> Credit:
    """Per-token advantages for each trajectory (completion tokens), as the algorithm says.

    `algorithm`: an Algorithm, or a name for rlvr.registry; `cfg.algorithm` when None.
    Shaping first (DAPO's soft overlong punishment), then the KL penalty when it is in the reward
    (`ref_logprobs` given: per completion token, under the reference), then one of
    - GAE (`token_credit="gae"`, ppo): per-token rewards, GAE against the critic's `values`,
      whitened over the batch;
    - reward-to-go (`token_credit="reward_to_go"`, reinforce_pp) when the KL is in the reward: per
      token, whitened over the batch;
    - the algorithm's advantage function (grpo, rloo, ...): one advantage per trajectory from the
      whole batch (`AdvantageBatch`: rewards with the KL summed in, validity, group size, lengths,
      turns), spread over tokens as `objective.credit` says. Turn credit sees the same shaped,
      KL-penalised reward, split by turn (`_shaped_turn_rewards`); so does gigpo, whose step
      advantages group turns by the state they acted from (`turn_state_keys`).

    Rows that did not score (a reward function raised) get no advantage and no KL: their reference
    log-probs are zeros (never computed), so their "KL" would be garbage (and the `kl` metric, which
    the KL blow-up monitor reads, with it).

    `objective.placebo: shuffle_within_group` (a control run) first hands each episode the rewards
    of a random member of its group (rlvr.algorithms.placebo), drawn from `train.seed` and `step`.
    """
    if not trajectories:
        return Credit([])
    if any(t.turn_of is not None for t in trajectories):
        return _turn_rows_credit(trajectories, cfg, algorithm, ref_logprobs, values, step)
    if cfg.objective.placebo == "shuffle_within_group":
        trajectories = placebo_rewards(trajectories, cfg.sampling.group_size, cfg.train.seed, step)
    if not isinstance(algorithm, Algorithm):
        resolved: Algorithm = ALGORITHMS.resolve(cfg.algorithm if algorithm is None else algorithm)
        algorithm = resolved
    obj = cfg.objective
    if obj.credit in ("turn", "gigpo") and not algorithm.group_relative:
        # Turn credit is group-relative over turn returns: another estimator would be silently unused.
        # GiGPO's step term is group-relative too, so its episode term must be (the paper's GRPO).
        raise ValueError(
            f"objective.credit {obj.credit!r} needs a group-relative estimator, not "
            f"{algorithm.name!r}"
        )
    metrics: dict[str, float] = {}
    shaping_B = torch.zeros(len(trajectories), device=HOST)
    if obj.overlong_buffer_fraction is not None:
        shaping_B = _overlong_shaping(trajectories, cfg)
        metrics["overlong/penalty_mean"] = float(shaping_B.mean())
        metrics["overlong/penalised_frac"] = float((shaping_B < 0).float().mean())
    valid_B = torch.tensor([t.usable for t in trajectories], device=HOST)
    masks = [[float(m) for m in t.policy_mask[t.prompt_length :]] for t in trajectories]
    kl_rows = None
    if ref_logprobs is not None and obj.beta > 0:
        kl_rows = _kl_rows(trajectories, ref_logprobs, masks, obj.kl_estimator)
        n_tokens = sum(sum(m) for t, m in zip(trajectories, masks, strict=True) if t.usable)
        metrics["kl"] = sum(sum(r) for r in kl_rows) / max(n_tokens, 1.0)
    gae = algorithm.token_credit == "gae"
    if gae or (algorithm.token_credit == "reward_to_go" and kl_rows is not None):
        credit = _token_level_credit(
            trajectories, masks, valid_B, shaping_B, kl_rows, values, algorithm, cfg
        )
        credit.metrics.update(metrics)
        return credit
    advantages_B = _outcome_advantages(trajectories, shaping_B, kl_rows, valid_B, algorithm, cfg)
    if obj.credit == "trajectory":
        return Credit(
            [token_advantages(t, a, None) for t, a in zip(trajectories, advantages_B, strict=True)],
            metrics=metrics,
        )
    shaped_turns = _shaped_turn_rewards(trajectories, shaping_B.tolist(), kl_rows, obj.beta)
    return _per_turn_credit(
        trajectories, advantages_B, shaped_turns, valid_B.tolist(), cfg, metrics
    )


def _outcome_advantages(
    trajectories: Sequence[Trajectory],
    shaping_B: torch.Tensor,
    kl_rows: Sequence[Sequence[float]] | None,
    valid_B: torch.Tensor,
    algorithm: Algorithm,
    cfg: RunConfig,
) -> list[float]:
    """One advantage per trajectory from the algorithm's advantage function, over the rewards with
    the shaping and (KL in the reward) -beta x the trajectory's summed KL folded in."""
    obj = cfg.objective
    rewards_B = torch.tensor([t.reward for t in trajectories], dtype=torch.float32, device=HOST)
    rewards_B = rewards_B + shaping_B
    if kl_rows is not None:
        rewards_B = rewards_B - obj.beta * torch.tensor([sum(r) for r in kl_rows], device=HOST)
    assert algorithm.advantage is not None  # only GAE algorithms have none (Algorithm checks)
    batch = AdvantageBatch(
        rewards_B=rewards_B,
        valid_B=valid_B,
        group_size=cfg.sampling.group_size,
        lengths_B=torch.tensor([t.num_policy_tokens for t in trajectories], device=HOST),
        turns_B=torch.tensor([len(t.turns) for t in trajectories], device=HOST),
        scale_rewards=obj.scale_rewards,
        trajectories=trajectories,
    )
    return algorithm.advantage(batch).tolist()


def _kl_rows(
    trajectories: Sequence[Trajectory],
    ref_logprobs: Sequence[Sequence[float]],
    masks: Sequence[Sequence[float]],
    estimator: str,
) -> list[list[float]]:
    """Per completion token, the KL estimate of the sampling policy's tokens (the behaviour
    log-probs) from the reference's; 0 off the policy tokens and on the rows that did not score
    (an unscored row's reference log-probs were never computed)."""
    kl_fn = KL_ESTIMATORS[estimator]
    kl_rows = []
    for t, ref, mask in zip(trajectories, ref_logprobs, masks, strict=True):
        if not t.usable:
            kl_rows.append([0.0] * len(mask))
            continue
        behaviour = torch.tensor(t.logprobs[t.prompt_length :], dtype=torch.float32, device=HOST)
        kl = kl_fn(behaviour, torch.tensor(list(ref), dtype=torch.float32, device=HOST))
        kl_rows.append(zero_outside(kl, torch.tensor(mask, device=HOST)).tolist())
    return kl_rows


def _token_level_credit(
    trajectories: Sequence[Trajectory],
    masks: Sequence[Sequence[float]],
    valid_B: torch.Tensor,
    shaping_B: torch.Tensor,
    kl_rows: Sequence[Sequence[float]] | None,
    values: Sequence[Sequence[float]] | None,
    algorithm: Algorithm,
    cfg: RunConfig,
) -> Credit:
    """Per-token credit: GAE against the critic's `values` (ppo), or REINFORCE++'s whitened
    reward-to-go when the KL is in the reward."""
    obj = cfg.objective
    mask_B_T = _padded(masks) * valid_B[:, None].float()
    # Each turn's reward on its last policy token (single-turn: the outcome on the last token),
    # the shaping on the very last one, minus beta * KL_t on every token when KL is in the reward.
    rewards_B_T = token_level_rewards(
        mask_B_T,
        shaping_B * valid_B.float(),
        [turn_reward_positions(t) if t.usable else [] for t in trajectories],
        _padded(kl_rows) if kl_rows is not None else None,
        obj.beta,
    )
    if algorithm.token_credit == "gae":
        assert values is not None, f"{algorithm.name} needs the critic's values"
        values_B_T = zero_outside(_padded(values), mask_B_T)
        adv_B_T, returns_B_T = gae_advantages(
            rewards_B_T, values_B_T, mask_B_T, obj.gamma, obj.gae_lambda
        )
        if obj.whiten_advantages:
            adv_B_T = whiten(adv_B_T, mask_B_T)
        return Credit(
            _unpadded(zero_outside(adv_B_T, mask_B_T), masks),
            returns=_unpadded(returns_B_T, masks),
            old_values=_unpadded(values_B_T, masks),
        )
    returns_B_T = reinforce_pp_returns(rewards_B_T, mask_B_T, obj.gamma)
    adv_B_T = whiten(returns_B_T, mask_B_T) if obj.whiten_advantages else returns_B_T
    return Credit(_unpadded(zero_outside(adv_B_T, mask_B_T), masks))


def _per_turn_credit(
    trajectories: Sequence[Trajectory],
    advantages_B: Sequence[float],
    shaped_turns: Sequence[Sequence[float]],
    valid: Sequence[bool],
    cfg: RunConfig,
    metrics: dict[str, float],
) -> Credit:
    """`objective.credit` gigpo, turn or bi-level: the episode advantages (`advantages_B`) with
    group-relative step / turn advantages over the shaped turn rewards."""
    obj, group_size = cfg.objective, cfg.sampling.group_size
    if obj.credit == "gigpo":
        keys = [turn_state_keys(t) for t in trajectories]
        step = gigpo_step_advantages(
            keys, shaped_turns, valid, group_size, obj.gamma, obj.scale_rewards == "group"
        )
        metrics.update(anchor_group_metrics(keys, shaped_turns, valid, group_size, obj.gamma))
        return Credit(
            [
                token_advantages(t, a, s, obj.turn_weight)
                if t.turns
                else token_advantages(t, a, None)
                for t, a, s in zip(trajectories, advantages_B, step, strict=True)
            ],
            metrics=metrics,
        )
    per_turn = turn_advantages(
        shaped_turns, valid, group_size, gamma=obj.gamma, scale=obj.scale_rewards == "group"
    )
    outcome = advantages_B if obj.credit == "bi-level" else [0.0] * len(trajectories)
    weight = obj.turn_weight if obj.credit == "bi-level" else 1.0
    return Credit(
        [
            token_advantages(t, a, turns, weight)
            for t, a, turns in zip(trajectories, outcome, per_turn, strict=True)
        ],
        metrics=metrics,
    )


def _turn_rows_credit(
    rows: Sequence[Trajectory],
    cfg: RunConfig,
    algorithm: Algorithm | str | None,
    ref_logprobs: Sequence[Sequence[float]] | None,
    values: Sequence[Sequence[float]] | None,
    step: int,
) -> Credit:
    """`assign_credit` for turn rows (module docstring): per-token inputs of the rows placed on
    their episodes' turn spans, the credit computed on the episodes, each row given its turn's
    slice. Every turn of an episode must be among the rows (a row without `turn_of` is its own
    episode), episodes group-major as `training_group` lays them out."""
    episodes: list[Trajectory] = []
    position: dict[int, int] = {}
    where: list[tuple[int, int | None]] = []  # row -> (its episode's index, its turn or None)
    for row in rows:
        episode = row.turn_of.episode if row.turn_of is not None else row
        e = position.setdefault(id(episode), len(episodes))
        if e == len(episodes):
            episodes.append(episode)
        where.append((e, row.turn_of.index if row.turn_of is not None else None))
    counts = [0] * len(episodes)
    for e, _ in where:
        counts[e] += 1
    for episode, count in zip(episodes, counts, strict=True):
        if count != max(1, len(episode.turns)):
            raise ValueError(
                f"episode {episode.task_id}: {count} rows for {len(episode.turns)} turns "
                "(every turn sample of an episode must be trained together)"
            )

    def spans(row: Trajectory, e: int, k: int) -> tuple[int, int, int]:
        """(where the turn's tokens start in the row's completion, in the episode's, how many)."""
        mine, theirs = row.turns[0], episodes[e].turns[k]
        n = mine.end - mine.start
        return mine.start - row.prompt_length, theirs.start - episodes[e].prompt_length, n

    def lift(per_row: Sequence[Sequence[float]] | None) -> list[list[float]] | None:
        if per_row is None:
            return None
        out = [[0.0] * (len(ep.token_ids) - ep.prompt_length) for ep in episodes]
        for row, row_values, (e, k) in zip(rows, per_row, where, strict=True):
            if k is None:
                out[e] = list(row_values)
                continue
            mine, theirs, n = spans(row, e, k)
            out[e][theirs : theirs + n] = list(row_values[mine : mine + n])
        return out

    def project(per_episode: Sequence[Sequence[float]] | None) -> list[list[float]] | None:
        if per_episode is None:
            return None
        out = []
        for row, (e, k) in zip(rows, where, strict=True):
            if k is None:
                out.append(list(per_episode[e]))
                continue
            mine, theirs, n = spans(row, e, k)
            values = [0.0] * (len(row.token_ids) - row.prompt_length)  # 0 on the kept turns
            values[mine : mine + n] = per_episode[e][theirs : theirs + n]
            out.append(values)
        return out

    credit = assign_credit(
        episodes, cfg, algorithm, ref_logprobs=lift(ref_logprobs), values=lift(values), step=step
    )
    advantages = project(credit.token_advantages)
    assert advantages is not None
    return Credit(
        advantages,
        returns=project(credit.returns),
        old_values=project(credit.old_values),
        metrics=credit.metrics,
    )


def placebo_rewards(
    trajectories: Sequence[Trajectory], group_size: int, seed: int, step: int
) -> list[Trajectory]:
    """The episodes with their rewards shuffled within each group (`objective.placebo`): episode i
    gets the reward, components and turn rewards of its partner (rlvr.algorithms.placebo), the
    permutation drawn from (seed, step) so a rerun shuffles alike. Tokens, masks and log-probs stay
    the episode's own, so the advantages land on the tokens it sampled."""
    rng = random.Random(f"placebo:{seed}:{step}")
    partners = placebo_partners([t.usable for t in trajectories], group_size, rng)
    out = []
    for t, j in zip(trajectories, partners, strict=True):
        partner = trajectories[j]
        out.append(
            dataclasses.replace(
                t,
                reward=partner.reward,
                rewards=dict(partner.rewards),
                turn_rewards=tuple(partner_turn_rewards(partner.turn_rewards, len(t.turn_rewards))),
            )
        )
    return out


def _shaped_turn_rewards(
    trajectories: Sequence[Trajectory],
    shaping: Sequence[float],
    kl_rows: Sequence[Sequence[float]] | None,
    beta: float,
) -> list[list[float]]:
    """Each trajectory's turn rewards with what the outcome reward also gets folded in, so turn and
    bi-level credit see the same objective as trajectory credit: the overlong shaping on the last
    turn (the length it punishes is the whole episode's), and -beta x the KL of each turn's own
    policy tokens on that turn (a policy token outside every turn span goes to the last turn)."""
    out = []
    for i, t in enumerate(trajectories):
        rewards = list(t.turn_rewards)
        if not rewards:  # no turns: turn credit gives it nothing to begin with
            out.append(rewards)
            continue
        rewards[-1] += shaping[i]
        if kl_rows is not None:
            last = len(rewards) - 1
            turn_of = [last] * len(kl_rows[i])  # completion position -> the turn it belongs to
            for k, span in enumerate(t.turns[: len(rewards)]):
                for position in range(span.start - t.prompt_length, span.end - t.prompt_length):
                    turn_of[position] = k
            turn_kl = [0.0] * len(rewards)
            for position, value in enumerate(kl_rows[i]):  # 0 off the policy tokens
                turn_kl[turn_of[position]] += value
            rewards = [r - beta * kl for r, kl in zip(rewards, turn_kl, strict=True)]
        out.append(rewards)
    return out


def _overlong_shaping(trajectories: Sequence[Trajectory], cfg: RunConfig) -> torch.Tensor:
    """DAPO's soft overlong penalty per trajectory. The limit is max_new_tokens for a one-turn
    episode and rollout.max_total_tokens (sampled tokens + observations) for a multi-turn one."""
    fraction = cfg.objective.overlong_buffer_fraction
    assert fraction is not None
    lengths, limits = [], []
    for t in trajectories:
        single = len(t.turns) <= 1
        limit = cfg.sampling.max_new_tokens if single else cfg.rollout.max_total_tokens
        lengths.append(t.num_policy_tokens if single else len(t.token_ids) - t.prompt_length)
        limits.append(limit)
    limits_B = torch.tensor(limits, dtype=torch.float32, device=HOST)
    return soft_overlong_penalty(
        torch.tensor(lengths, device=HOST),
        limits_B,
        limits_B * fraction,
        cfg.objective.overlong_penalty,
    )
