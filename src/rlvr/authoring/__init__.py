"""Tools for env authors that play envs through the rollout engine: `rlvr env check` (check.py)
and `rlvr env demos` (demos.py).

They sit above rollout and the trainer's task sources, so that envs/ itself sees only text: an env
never imports a generator, a chat template or the trainer (tests/test_layers.py).
"""
