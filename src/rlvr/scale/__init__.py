"""Beyond one process: Ray rollout workers, torchrun data/fully-sharded parallel updates, async rollouts.

Each piece keeps the loop of rlvr.train.loop: what changes is where episodes are played and how the
gradient is reduced. Weights move one way, learner -> samplers, after every update (weights.py).
"""
