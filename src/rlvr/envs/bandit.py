"""Two-armed bandit: pick the slot-machine arm that pays more on average, in a single turn.

After the bi-arm bandit of RAGEN (Wang et al., 2025, "RAGEN: Understanding Self-Evolution in LLM
Agents via Multi-Turn Reinforcement Learning"), which names the arms with words such as "phoenix" and
"dragon" to test whether a policy reasons from the payouts or from the names. Here both payout
tables are stated in the prompt: a low-risk arm pays a few coins with a high probability, a
high-risk arm pays many coins with a low probability, and their expected values differ by at least
`min_gap` (relative). Which arm is better is drawn per instance (or fixed by `better`), as are the
names, which name is the risky arm and the order the arms are listed in.

Rules: answer one arm name inside <answer></answer> (case-insensitive). Reward parts: `success` 1.0
iff the chosen arm has the higher expected value; `payout` (weight 0, logged) the chosen arm's
expected value divided by the better arm's, in [0, 1]; `invalid_action` 1.0 (weight -0.1) when the
answer is missing or names no arm. The episode always ends after the one turn; no payout is sampled,
so the reward is deterministic.

Split: by payout tables (`split_key`), names and listing order left out: the same two tables
under other names are the same decision, so they never sit on both sides.

Working (`working: true`): the prompt asks for each arm's coins x percent before the answer, as
"phoenix 3 x 80 = 240, dragon 20 x 10 = 200, 240 > 200 <answer>phoenix</answer>", and the scripted
solver writes that. `success` scores only the answer; the reward part `working` (weight 0: logged,
not optimised, unless `task.env.reward_weights.working` is set) is the share of its three checks that
hold: each arm's product written right after its name, coins and percent, and a comparison
"A > B" whose A is the named arm's product and B the other's, A truly the larger (0 for an
answer that names no arm; a task without working has no such part, logged as 0). A one-word answer leaves the product to a single
next-token choice, which SmolLM2-135M did not learn from 512 right answers (docs/efficacy_notes.md,
bandit); written out, the decision is a lookup in a small multiplication table (99 payout tables
for the low-risk arm, 56 for the high-risk one) and a comparison of two integers.

Demonstration policies (rlvr.authoring.demos): `random_action` names one of the two arms at random (a
format warm-up: right half the time); `scripted_action` names the better arm (behaviour cloning),
after its working when the task asks for it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlvr.envs.base import (
    Env,
    EnvFamily,
    EnvOptions,
    EnvReset,
    EnvStep,
    Message,
    register_env,
)
from rlvr.errors import ConfigError
from rlvr.records import Task
from rlvr.verifiers.builtin import extract_tagged

NAME_PAIRS: tuple[tuple[str, str], ...] = (
    ("phoenix", "dragon"),
    ("gold", "silver"),
    ("red", "blue"),
    ("sun", "moon"),
    ("lion", "tiger"),
    ("oak", "pine"),
    ("river", "mountain"),
    ("ruby", "jade"),
    ("falcon", "owl"),
    ("apple", "cherry"),
    ("north", "south"),
    ("alpha", "beta"),
)

EXAMPLE_ARM = "kestrel"  # the prompt's format example: not a name in NAME_PAIRS, so never an arm
EXAMPLE_OTHER_ARM = "wren"  # the working example's second arm, likewise never offered


class BanditOptions(EnvOptions):
    min_gap: float = Field(
        0.2,
        ge=0.0,
        le=0.9,
        description="Least relative gap between the arms' expected values, |a - b| / max(a, b).",
    )
    better: Literal["random", "low_risk", "high_risk"] = Field(
        "random", description="Which arm has the higher expected value (RAGEN: high_risk)."
    )
    working: bool = Field(
        False,
        description="Ask for each arm's coins x percent before the answer (the scripted solver "
        "writes it); only the answer is scored.",
    )


def expected_value(arm: Mapping[str, Any]) -> float:
    """Coins times the probability of paying them, for an arm {"name", "coins", "percent"}."""
    return float(arm["coins"]) * float(arm["percent"]) / 100.0


def product(arm: Mapping[str, Any]) -> int:
    """Coins times percent: 100x the arm's expected value, the integer the working writes."""
    return int(arm["coins"]) * int(arm["percent"])


def make_task(arms: list[dict[str, Any]], working: bool = False) -> Task:
    """The task for two arms given in display order; its id lists both payout tables (and ends in
    `:working` when the prompt asks for the products before the answer)."""
    system = (
        "You are playing a slot machine with two arms. Each pull of an arm pays the stated coins "
        "with the stated chance, else nothing. Choose the arm that pays more coins on average."
    )
    table = "\n".join(
        f"Arm {a['name']}: {a['coins']} coin{'s' if a['coins'] != 1 else ''} with probability {a['percent']}%, else 0."
        for a in arms
    )
    # The example names an arm that is never offered: an example naming one of the two arms was
    # copied by SmolLM2-135M (it answered the first-listed arm in 501 of 502 samples after training,
    # docs/efficacy_notes.md), which pays half the time whatever the payouts are.
    if working:
        example = working_text(
            [
                {"name": EXAMPLE_ARM, "coins": 4, "percent": 50},
                {"name": EXAMPLE_OTHER_ARM, "coins": 10, "percent": 15},
            ]
        )
        user = (
            f"{table}\nFirst multiply each arm's coins by its percent, then answer with the name "
            f"of the arm with the larger product inside <answer></answer>. For arms named "
            f"{EXAMPLE_ARM} and {EXAMPLE_OTHER_ARM} that would be: {example}"
        )
    else:
        user = (
            f"{table}\nAnswer with the name of one arm inside <answer></answer>: for an arm named "
            f"{EXAMPLE_ARM} that would be <answer>{EXAMPLE_ARM}</answer>."
        )
    key = "bandit:" + ",".join(f"{a['name']}={a['coins']}@{a['percent']}" for a in arms)
    messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
    fields: dict[str, Any] = {"arms": arms}
    if working:  # a task without working stays as it was before the option existed
        key += ":working"
        fields["working"] = True
    return Task(id=key, messages=messages, fields=fields)


def working_text(arms: list[Mapping[str, Any]]) -> str:
    """Each arm's coins x percent in the listed order, their comparison, then the better arm's
    answer: "gold 5 x 90 = 450, silver 20 x 10 = 200, 450 > 200 <answer>gold</answer>". The
    products are 100x the expected values; the better arm is the one `step` rewards."""
    parts = [f"{a['name']} {a['coins']} x {a['percent']} = {product(a)}" for a in arms]
    best = max(arms, key=expected_value)
    (other,) = (a for a in arms if a is not best)
    return f"{', '.join(parts)}, {product(best)} > {product(other)} <answer>{best['name']}</answer>"


def working_score(text: str, arms: Sequence[Mapping[str, Any]], chosen: Mapping[str, Any]) -> float:
    """The share of the working's three checks that `text` passes: each arm's "name coins x
    percent = product" with the product right (its first such statement counts), and the first
    comparison "A > B" naming the chosen arm's true product as A and the other's as B, with
    A > B. A right comparison for a wrong answer cannot hold, since A must be the larger."""
    checks = []
    for arm in arms:
        pattern = (
            rf"\b{re.escape(str(arm['name']))}\s+{arm['coins']}\s*x\s*{arm['percent']}\s*=\s*(\d+)"
        )
        found = re.search(pattern, text, flags=re.IGNORECASE)
        checks.append(found is not None and int(found.group(1)) == product(arm))
    (other,) = (a for a in arms if a is not chosen)
    mine, theirs = product(chosen), product(other)
    comparison = re.search(r"(\d+)\s*>\s*(\d+)", text)
    checks.append(
        comparison is not None
        and (int(comparison.group(1)), int(comparison.group(2))) == (mine, theirs)
        and mine > theirs
    )
    return sum(checks) / len(checks)


class BanditEnv(Env):
    """One single-turn bandit episode."""

    max_turns = 1

    def __init__(self, task: Task) -> None:
        self.task = task
        self.arms = [dict(a) for a in task.fields["arms"]]
        self.done = False

    def reset(self) -> EnvReset:
        return EnvReset(messages=[dict(m) for m in self.task.messages])

    def step(self, assistant_text: str) -> EnvStep:
        if self.done:
            raise RuntimeError("step() called after the episode ended")
        self.done = True
        answer = extract_tagged(assistant_text, "answer")
        key = (answer or "").strip().strip(".!'\"`").lower().removeprefix("arm ").strip()
        chosen = next((a for a in self.arms if str(a["name"]).lower() == key), None)
        if chosen is None:
            rewards = {"success": 0.0, "payout": 0.0, "invalid_action": 1.0}
            if self.task.fields.get("working"):
                rewards["working"] = 0.0
            return EnvStep(rewards=rewards, done=True, info={"invalid_action": 1})
        best = max(expected_value(a) for a in self.arms)
        value = expected_value(chosen)
        rewards = {
            "success": float(value == best),
            "payout": value / best if best > 0 else 0.0,
            "invalid_action": 0.0,
        }
        if self.task.fields.get("working"):  # a part only these tasks have (the engine logs 0 else)
            rewards["working"] = working_score(assistant_text, self.arms, chosen)
        info = {"high_risk": int(chosen["risk"] == "high")}
        return EnvStep(rewards=rewards, done=True, info=info)


@register_env
class BanditFamily(EnvFamily):
    name: ClassVar[str] = "bandit"
    description: ClassVar[str] = (
        "Pick the two-armed bandit arm with the higher expected payout (RAGEN)."
    )
    Options: ClassVar[type[EnvOptions]] = BanditOptions
    success_metric: ClassVar[str] = "success"
    reward_weights: ClassVar[Mapping[str, float]] = {
        "success": 1.0,
        "payout": 0.0,
        "invalid_action": -0.1,
        "working": 0.0,  # the `working` option's written products and comparison (logged)
    }
    example_config: ClassVar[str] = "examples/env_bandit.yaml"

    def generate(self, seed: int) -> Task:
        opts = self.options
        assert isinstance(opts, BanditOptions)
        rng = random.Random(seed)
        better = opts.better if opts.better != "random" else rng.choice(["low_risk", "high_risk"])
        for _ in range(10_000):
            names = list(rng.choice(NAME_PAIRS))
            rng.shuffle(names)  # names[0] is the low-risk arm
            low = {
                "name": names[0],
                "coins": rng.randint(1, 9),
                "percent": rng.randrange(50, 101, 5),
            }
            high = {
                "name": names[1],
                "coins": rng.randrange(10, 41, 5),
                "percent": rng.randrange(5, 45, 5),
            }
            low_ev, high_ev = expected_value(low), expected_value(high)
            gap = abs(low_ev - high_ev)
            if gap == 0 or gap < opts.min_gap * max(low_ev, high_ev):
                continue
            if (high_ev > low_ev) != (better == "high_risk"):
                continue
            low["risk"], high["risk"] = "low", "high"
            arms = [low, high]
            rng.shuffle(arms)
            return make_task(arms, opts.working)
        raise ConfigError(f"bandit: no arms found for seed {seed}; lower task.env.options.min_gap")

    def split_key(self, task: Task) -> str:
        """The two payout tables, sorted: the decision without the arms' names or order."""
        tables = sorted((int(a["coins"]), int(a["percent"])) for a in task.fields["arms"])
        return "bandit-payouts:" + ",".join(f"{c}@{p}" for c, p in tables)

    def make(self, task: Task) -> Env:
        return BanditEnv(task)

    def random_action(self, task: Task, messages: list[Message], rng: random.Random) -> str:
        """One of the two arms' names, chosen blindly."""
        return f"<answer>{rng.choice(task.fields['arms'])['name']}</answer>"

    def scripted_action(self, task: Task, messages: list[Message]) -> str:
        """The arm with the higher expected payout, after its working when the task asks for it."""
        if task.fields.get("working"):
            return working_text(task.fields["arms"])
        return f"<answer>{max(task.fields['arms'], key=expected_value)['name']}</answer>"
