"""An env whose step is pure-Python CPU work, for benchmarks/ray_scaling.py.

Each turn the env seeds a random soup on a 40 x 40 torus from the task, the turn and the assistant's
reply, runs Conway's Game of Life on it for `generations` generations in plain Python, and reports
how many cells live (a fresh soup each turn keeps every step's work about the same). About 60-80 ms of interpreter work per step on this
machine (the benchmark prints the measured figure): holding the interpreter lock the whole time, so
threads stepping several envs run them one after another, while processes run them at once.

Config: task.env.name: benchmarks/ray_scaling_env.py:LifeFamily
"""

from __future__ import annotations

import random

from rlvr.envs import Env, EnvFamily, EnvReset, EnvStep
from rlvr.envs.base import EnvOptions
from rlvr.records import Task


class LifeOptions(EnvOptions):
    size: int = 40
    generations: int = 40
    turns: int = 3


def life(alive: set[tuple[int, int]], size: int, generations: int) -> set[tuple[int, int]]:
    """`generations` steps of Life on a size x size torus; cells as (row, col)."""
    for _ in range(generations):
        counts: dict[tuple[int, int], int] = {}
        for r, c in alive:
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    if dr or dc:
                        key = ((r + dr) % size, (c + dc) % size)
                        counts[key] = counts.get(key, 0) + 1
        alive = {cell for cell, n in counts.items() if n == 3 or (n == 2 and cell in alive)}
    return alive


class LifeEnv(Env):
    def __init__(self, task: Task, options: LifeOptions) -> None:
        self.task = task
        self.options = options
        self.max_turns = options.turns
        self.turn = 0

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        size = self.options.size
        self.turn += 1
        rng = random.Random(f"{self.task.fields['seed']}:{self.turn}:{assistant_text}")
        soup = {(r, c) for r in range(size) for c in range(size) if rng.random() < 0.35}
        alive = life(soup, size, self.options.generations)
        share = len(alive) / (size * size)
        done = self.turn >= self.options.turns
        observation = [] if done else [{"role": "user", "content": f"{len(alive)} live."}]
        return EnvStep(
            messages=observation, rewards={"alive": share / self.options.turns}, done=done
        )


class LifeFamily(EnvFamily):
    name = "bench_life"
    description = "Light cells, then Life runs: a CPU-bound pure-Python env step (benchmark)."
    Options = LifeOptions
    success_metric = "alive"

    def generate(self, seed: int) -> Task:
        return Task(
            id=f"life:{seed}",
            messages=({"role": "user", "content": f"Soup {seed}: light cells."},),
            fields={"seed": seed},
        )

    def make(self, task: Task) -> Env:
        assert isinstance(self.options, LifeOptions)
        return LifeEnv(task, self.options)
