"""Credit assignment for multi-turn trajectories: which advantage each policy token gets.

Three modes (`objective.credit`):
- trajectory: every policy token of trajectory i gets A_i, its group-relative advantage (GRPO's
  outcome supervision; RAGEN's StarPO default).
- turn: turn k of a trajectory gets the group-relative advantage of its discounted return
  R_k = sum_{j >= k} gamma^(j-k) r_j, normalised over all (trajectory, turn) returns of the group,
  so a turn that leads to reward later is credited and a wasted turn after the reward is not.
- bi-level: A_i + turn_weight * A_turn(i, k): the episode's outcome plus the turn's own share, the
  combination GiGPO (Feng et al. 2025) uses; RAGEN's bi-level GAE needs a critic, which comes with PPO.
- gigpo: A_i + turn_weight * A_step(i, k), where the step advantage normalises turn k's return only
  among the group's turns that acted from the same state ("anchor state"; GiGPO, Feng et al. 2025).

Everything here is a pure function of rewards; tokens of turn k are found from `Trajectory.turns`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from rlvr.records import Trajectory


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_k = r_k + gamma * R_{k+1}, computed backwards. Length = number of turns."""
    out = [0.0] * len(rewards)
    running = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def turn_advantages(
    turn_rewards: Sequence[Sequence[float]],
    valid: Sequence[bool],
    group_size: int,
    gamma: float = 1.0,
    scale: bool = True,
    eps: float = 1e-4,
) -> list[list[float]]:
    """Group-relative advantages of discounted turn returns; one list (per turn) per trajectory.

    Within each group of `group_size` consecutive trajectories, the returns of every turn of every
    valid trajectory are pooled: A = (R - mean) / (std + eps) (Bessel std; no division when
    `scale` is False). A group whose pooled returns are all equal gets 0; invalid trajectories get 0.
    """
    if len(turn_rewards) % group_size:
        raise ValueError(
            f"{len(turn_rewards)} trajectories do not split into groups of {group_size}"
        )
    returns = [discounted_returns(r, gamma) for r in turn_rewards]
    out: list[list[float]] = [[0.0] * len(r) for r in returns]
    for start in range(0, len(returns), group_size):
        members = [i for i in range(start, start + group_size) if valid[i]]
        pool = [value for i in members for value in returns[i]]
        if len(pool) < 2 or max(pool) == min(pool):
            continue
        mean = sum(pool) / len(pool)
        std = math.sqrt(sum((v - mean) ** 2 for v in pool) / (len(pool) - 1))
        for i in members:
            out[i] = [(v - mean) / (std + eps) if scale else v - mean for v in returns[i]]
    return out


def token_advantages(
    trajectory: Trajectory,
    trajectory_advantage: float,
    turn_advantage: Sequence[float] | None,
    turn_weight: float = 1.0,
) -> list[float]:
    """One advantage per completion token (after the prompt); 0 outside the assistant turns.

    `turn_advantage` None: trajectory credit. Else turn k's tokens get
    trajectory_advantage + turn_weight * turn_advantage[k] (pass trajectory_advantage 0 for pure
    turn credit).
    """
    n = len(trajectory.token_ids) - trajectory.prompt_length
    if turn_advantage is None:
        mask = trajectory.policy_mask[trajectory.prompt_length :]
        return [trajectory_advantage if m else 0.0 for m in mask]
    out = [0.0] * n
    for span, adv in zip(trajectory.turns, turn_advantage, strict=True):
        value = trajectory_advantage + turn_weight * adv
        for t in range(span.start, span.end):
            out[t - trajectory.prompt_length] = value
    return out


# ------------------------------------------------------------------------------ GiGPO anchor states
def turn_state_keys(trajectory: Trajectory) -> list[Hashable]:
    """The state each turn acted from, as a hashable key; one per turn (`Trajectory.turns`).

    - Turn 0: the env's key of its opening state where the reset gave one (`info
      ["initial_state_key"]`, EnvReset.state_key), so a later return to the start joins the first
      turns' anchor group; else the prompt's token ids (all G episodes of a task share them, so the
      first turns of a group form one anchor group; an env whose reset varies per episode splits
      them honestly).
    - Turn k >= 1: the env's own key when its step before turn k put `info["state_key"]` (recorded by
      the engine in `info["state_keys"]`, one per step, None where absent); otherwise the exact
      observation messages the policy saw before turn k (every field of every non-assistant message
      between assistant messages k-1 and k of `Trajectory.messages`, as sent: truncated if it was).
    - A turn whose observation cannot be found (the assistant messages do not line up with the
      turns, e.g. a recording without them) gets a key equal to nothing else: a singleton group.

    Keys are tagged ("prompt", "env", "observation") so a state of one kind never equals another's.
    Text equality is the default because it is what the policy conditions on; it is strict (an
    observation that also narrates the last move splits equal positions), which an env can refine
    with `state_key`.
    """
    n = len(trajectory.turns)
    if n == 0:
        return []
    initial = trajectory.info.get("initial_state_key")
    first = ("prompt", trajectory.token_ids[: trajectory.prompt_length])
    keys: list[Hashable] = [first if initial is None else ("env", initial)]
    observations: list[tuple[tuple[tuple[str, str], ...], ...]] = []
    current: list[tuple[tuple[str, str], ...]] | None = None
    assistants = 0
    for message in trajectory.messages:
        if message.get("role") == "assistant":
            assistants += 1
            if current is not None:
                observations.append(tuple(current))
            current = []
        elif current is not None:
            current.append(tuple(sorted((str(k), str(v)) for k, v in message.items())))
    lined_up = assistants == n
    explicit = list(trajectory.info.get("state_keys", ()))
    for k in range(1, n):
        if k - 1 < len(explicit) and explicit[k - 1] is not None:
            keys.append(("env", explicit[k - 1]))
        elif lined_up:
            keys.append(("observation", observations[k - 1]))
        else:
            keys.append(("unmatched", object()))
    return keys


def anchor_groups(
    state_keys: Sequence[Sequence[Hashable]], valid: Sequence[bool], group_size: int
) -> list[list[tuple[int, int]]]:
    """Step-level groups: the (trajectory, turn) pairs of one episode group's valid trajectories
    that acted from equal states, any turn index (a state revisited later joins its group). Listed
    group by group, each in first-seen order; invalid trajectories belong to none."""
    if len(state_keys) % group_size:
        raise ValueError(f"{len(state_keys)} trajectories do not split into groups of {group_size}")
    out: list[list[tuple[int, int]]] = []
    for start in range(0, len(state_keys), group_size):
        by_state: dict[Hashable, list[tuple[int, int]]] = {}
        for i in range(start, start + group_size):
            if valid[i]:
                for k, key in enumerate(state_keys[i]):
                    by_state.setdefault(key, []).append((i, k))
        out.extend(by_state.values())
    return out


def _informative(values: Sequence[float]) -> bool:
    # Two members at least and max - min > 0: the codebase's one "no signal" rule (_group_spread).
    return len(values) > 1 and max(values) - min(values) != 0


def gigpo_step_advantages(
    state_keys: Sequence[Sequence[Hashable]],
    turn_rewards: Sequence[Sequence[float]],
    valid: Sequence[bool],
    group_size: int,
    gamma: float = 1.0,
    scale: bool = True,
    eps: float = 1e-4,
) -> list[list[float]]:
    """GiGPO's step-level advantage (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM
    Agent Training", sec. 4.2); one list (one value per turn) per trajectory.

    Shapes: B = len(state_keys) = len(turn_rewards) = len(valid) trajectories, group-major in
    groups of `group_size`; trajectory i has K_i turns, state_keys[i] and turn_rewards[i] both K_i.
    Within each group, the turns of valid trajectories whose state keys are equal form an anchor
    group U (`anchor_groups`). With R_{i,k} = sum_{j >= k} gamma^(j-k) r_{i,j} (the discounted return
    from turn k to the end of episode i):

        A_step(i, k) = (R_{i,k} - mean_U R) / (std_U R + eps)    (scale; Bessel std, as grpo)
        A_step(i, k) =  R_{i,k} - mean_U R                       (not scale, as Dr.GRPO)

    exactly 0 where U has one member or its returns are all equal (max - min == 0), and for invalid
    trajectories. The final advantage of turn k's tokens is A_i + omega * A_step(i, k), with A_i
    the episode's group-relative advantage and omega = `objective.turn_weight`.
    """
    if len(turn_rewards) != len(state_keys):
        raise ValueError(f"{len(state_keys)} key rows for {len(turn_rewards)} reward rows")
    for i, (keys, rewards) in enumerate(zip(state_keys, turn_rewards, strict=True)):
        if len(keys) != len(rewards):
            raise ValueError(f"trajectory {i}: {len(keys)} state keys for {len(rewards)} turns")
    returns = [discounted_returns(r, gamma) for r in turn_rewards]
    out: list[list[float]] = [[0.0] * len(r) for r in returns]
    for members in anchor_groups(state_keys, valid, group_size):
        values = [returns[i][k] for i, k in members]
        if not _informative(values):
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for (i, k), v in zip(members, values, strict=True):
            out[i][k] = (v - mean) / (std + eps) if scale else v - mean
    return out


def anchor_group_metrics(
    state_keys: Sequence[Sequence[Hashable]],
    turn_rewards: Sequence[Sequence[float]],
    valid: Sequence[bool],
    group_size: int,
    gamma: float = 1.0,
) -> dict[str, float]:
    """What GiGPO adds beyond the episode: over the anchor groups of the turns after the first
    (states reached by acting), their mean size and the fraction with a return spread (> 1 member,
    max - min > 0). Both 0 when there are none (single-turn episodes)."""
    returns = [discounted_returns(r, gamma) for r in turn_rewards]
    later = [g for g in anchor_groups(state_keys, valid, group_size) if g[0][1] > 0]
    if not later:
        return {"credit/anchor_group_size_mean": 0.0, "credit/anchor_groups_informative_frac": 0.0}
    informative = [_informative([returns[i][k] for i, k in g]) for g in later]
    return {
        "credit/anchor_group_size_mean": sum(len(g) for g in later) / len(later),
        "credit/anchor_groups_informative_frac": sum(informative) / len(later),
    }
