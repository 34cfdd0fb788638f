"""Beyond one process: Ray rollout workers, torchrun data/fully-sharded parallel updates, async rollouts.

Each piece keeps the loop of rlvr.train.loop: what changes is where episodes are played and how the
gradient is reduced. Weights move one way, learner -> samplers, after every update (weights.py).
"""

from __future__ import annotations


def chunk_bounds(n_items: int, n_chunks: int) -> list[tuple[int, int]]:
    """[start, end) of `n_chunks` contiguous chunks (Ray workers' task chunks, torchrun ranks' shares) covering range(n_items), sizes differing by at
    most one (the first n_items % n_chunks chunks get the extra item); some are empty when
    n_items < n_chunks."""
    base, extra = divmod(n_items, n_chunks)
    bounds, start = [], 0
    for k in range(n_chunks):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
