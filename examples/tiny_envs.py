"""A multi-turn env a random tiny model can learn in seconds, written as a user would write one.

Each turn the user asks for digits; the reply's share of digit characters, divided by the number of
turns, is that turn's reward, so an episode's reward is in [0, 1].
Used by examples/tiny_multiturn.yaml (`task.env.name: tiny_envs.py:DigitsFamily`) and by the CI
multi-turn learning test: observations ("Again, ...") sit between the turns and get no gradient.
"""

from __future__ import annotations

from rlvr.envs import Env, EnvFamily, EnvReset, EnvStep
from rlvr.records import Task


def digit_fraction(text: str) -> float:
    text = text.strip()
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


class DigitsEnv(Env):
    max_turns = 3

    def __init__(self, task: Task) -> None:
        self.task = task

    def reset(self) -> EnvReset:
        return EnvReset([dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        return EnvStep(
            messages=[{"role": "user", "content": "Again, digits only."}],
            rewards={"digits": digit_fraction(assistant_text) / self.max_turns},
        )


class DigitsFamily(EnvFamily):
    name = "tiny_digits"
    description = "Reply in digits, three times; each turn pays its share of digits."
    success_metric = "digits"

    def generate(self, seed: int) -> Task:
        return Task(id=f"digits:{seed}", messages=({"role": "user", "content": f"Say {seed}."},))

    def make(self, task: Task) -> Env:
        return DigitsEnv(task)
