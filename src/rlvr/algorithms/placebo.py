"""The placebo control: rewards shuffled within each group, so an update has RL's scale and no signal.

`objective.placebo: shuffle_within_group` gives each trajectory the reward of another member of its
own group, drawn by a uniformly random permutation of the group's valid members, before any credit
is assigned. The group's rewards are the same multiset, so every group statistic (mean, std, spread,
which groups the filter keeps, how many rows have a non-zero advantage) and hence the size of the
update are those of a real step; but which trajectory gets which reward is independent of what it
did, so the expected advantage of every trajectory is 0 and the update is a random walk of RL's own
step size. A run trained this way beside a real one (same warm-up checkpoint, same seed) tells what
part of a gain came from the reward and what from the update's noise, the learning rate or the
extra sampling alone. It is a control, never a training mode.

Multi-turn episodes carry per-turn rewards as well: a trajectory gets its partner's turn rewards
laid out from its own last turn backwards (the partner's last turn's reward on its own last turn);
a partner with more turns has its earliest turns' rewards summed onto the first turn, one with
fewer leaves the earliest turns at 0, so the total is always the partner's episode return.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def placebo_partners(valid: Sequence[bool], group_size: int, rng: random.Random) -> list[int]:
    """For each trajectory, the index of the trajectory whose rewards it receives.

    Within each group of `group_size` consecutive trajectories, the valid members are permuted
    uniformly at random among themselves (`rng.shuffle`); an invalid member (its reward function
    raised) keeps itself, so it still trains on nothing. Shapes: len(valid) = B = P * group_size.
    """
    if len(valid) % group_size:
        raise ValueError(f"{len(valid)} trajectories do not split into groups of {group_size}")
    partners = list(range(len(valid)))
    for start in range(0, len(valid), group_size):
        members = [i for i in range(start, start + group_size) if valid[i]]
        shuffled = list(members)
        rng.shuffle(shuffled)
        for i, j in zip(members, shuffled, strict=True):
            partners[i] = j
    return partners


def partner_turn_rewards(partner: Sequence[float], num_turns: int) -> list[float]:
    """The partner's per-turn rewards on a trajectory of `num_turns` turns, aligned at the last turn
    (module docstring); their sum is the partner's whole return. [] for a trajectory with no turns."""
    if num_turns == 0:
        return []
    out = [0.0] * num_turns
    extra = len(partner) - num_turns
    for k, value in enumerate(partner):
        out[max(k - extra, 0)] += value  # the partner's earliest turns fold onto turn 0
    return out
