"""The efficacy table: does training teach SmolLM2-135M each built-in task? Held-out before and after.

(Over 500 lines: the row table is data, one entry per measured task; the base-model cache lives in
_efficacy_cache.py, the chance / solver plays in _efficacy_chance.py and the table's rendering in
_efficacy_table.py; measuring and the CLI stay together so one file is the instrument.)

For each row (an env or task at one difficulty, trained from its example config) this script
1. scores the base model on the first `--n` held-out instances (all of them where fewer exist):
   greedy pass@1 per instance, and mean@k (k samples at the config's training temperature);
2. trains from the example config with `train.time_limit_minutes` = `--budget-minutes` (the run
   stops after the first step past it, or at the config's step count), no in-run evals;
3. scores the trained model (the run's last checkpoint) on the same instances the same way;
4. reports the gain with a 95% paired-bootstrap confidence interval (10,000 resamples of the
   instances; before and after are paired per instance), tool-call rate and turns per episode
   after training, steps done, wall minutes of training and the CPU it ran on.

A warm-up row (`pipeline=True`, examples/env_*_warmup.yaml) runs a pipeline instead: an SFT format
warm-up on demonstrations of random legal actions played on the RL config's train instances
(rlvr.authoring.demos: they teach the answer format, not the task), then the RL stage with what is left
of the budget. It also scores the warm-up's model alone (`after warm-up`), so the gain RL adds over
the format is reported apart (`rl_gain`); its training minutes include the warm-up.

The base model's per-instance results are cached (benchmarks/_efficacy_cache.py says under what key):
a row re-measured with other hyper-parameters then says `base: cached (<key prefix>)`.

Held-out instances come from each env family's own split (disjoint from training by content,
solution and reachable start state: tests/test_splits.py); nothing here is tuned on them: the configs are the
examples as committed. Each finished row is appended to `--results` (JSONL, one object per row and
run), and `--out` (docs/efficacy.md) is regenerated from the newest result of every row, so rows
can be measured in separate invocations: the table is the instrument's output, never hand-edited.
`--seeds 0 1 2` measures a row once per seed (`train.seed` of every stage); the table averages the
newest series of seeds measured the same way and shows their spread (_efficacy_seeds.py).

The chance column and the solver ceiling (_efficacy_chance.py) need no model: `--chance-only` plays
each env row's random legal policy and scripted solver on its held-out instances (seconds a row) and
appends them, per instance, to --chance-results; the table reads the newest of each.

A placebo arm (`--placebo`) trains each row once more from the same warm-up and seed with
`objective.placebo: shuffle_within_group` (rewards shuffled within groups: a real step's size, no
information); the result gains the placebo's after and "RL over placebo" with its paired interval.
`--warmup-only` trains a warm-up row's clone once; `--warmup-from DIR` then starts every seed's RL
(and its placebo arm) from that one clone. Every result stores the RL run's recipe and its per-step
signal (`per_step`: episodes, successes, groups with a reward / success contrast, lr in force,
update norm relative to the weights).

Usage: python benchmarks/efficacy.py [--rows arithmetic calculator-1op ...] [--budget-minutes 30]
       [--n 200] [--k 4] [--seeds 0 1 2] [--list] [--warmup-set train.steps=8] [--no-base-cache]
       [--chance-only [--chance-episodes 8]] [--render-only]
       [--warmup-only | --warmup-from DIR] [--placebo]
       (`make efficacy` runs every row: hours on 2 cores)
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling module, however this file was loaded
import _efficacy_cache as base_cache  # noqa: E402
import _efficacy_chance as chance_lib  # noqa: E402
import _efficacy_table as efficacy_table  # noqa: E402
from _efficacy_table import heldout_changed  # noqa: E402, F401  (tests read it here)


@dataclass(frozen=True)
class Row:
    """One line of the table: a config, the overrides that set its difficulty, and its target."""

    name: str
    task: str  # what the table's first column says
    config: str  # file in examples/
    target: str  # the target, as text
    target_gain: float | None = (
        None  # points of held-out gain the target asks for, when it is a gain
    )
    target_after: float | None = None  # held-out accuracy the target asks for, when it is a level
    overrides: tuple[str, ...] = field(default_factory=tuple)
    max_minutes: float | None = None  # training wall time the target allows
    min_tool_rate: float | None = None  # share of held-out episodes that call a tool
    pipeline: bool = False  # config is a pipeline: warm-up stages, then its RL stage
    # Set on every warm-up stage itself (not its config), e.g. env_demos.policy=scripted.
    stage_overrides: tuple[str, ...] = field(default_factory=tuple)
    not_run: str = ""  # why the row is left unmeasured on purpose (the table prints it)


# Env rows score 200 held-out instances (the example configs evaluate on fewer during training).
HELDOUT_200 = ("task.env.num_heldout=200",)
# A 5x5 room (3x3 floor, 1 box) has only 580 distinct levels (seeds 0-20k) in about 70 rooms, so the
# default 10% split cannot hold out 200: half of the rooms are held out instead (the split is by
# room, sokoban's split_key), 200 of their levels used, and 230 levels of the other rooms train.
SOKOBAN_5X5 = (
    *HELDOUT_200,
    "task.env.heldout_fraction=0.5",
    "task.env.num_train=230",
    "task.env.options.size=5",
)
# GiGPO (Feng et al. 2025): step advantages among turns from the same state, discount 0.95 as in
# the paper; the rows without it are the trajectory-credit baselines on the same budget.
GIGPO = ("objective.credit=gigpo", "objective.gamma=0.95")
# Per-turn credit: each turn's discounted return, group-relative among the group's turns.
TURN = ("objective.credit=turn", "objective.gamma=0.95")


def no_format(tagged: int, env: str) -> str:
    """Why RL without a warm-up is not run on `env`: the base model almost never writes the answer
    format (probe in docs/efficacy_notes.md, frozenlake section), so nearly every group's rewards are
    equal and RL has almost nothing to compare; plain frozenlake, measured, stayed at 0% after 15 steps."""
    return (
        f"not run: bare SmolLM2 wrote the answer format in {tagged} of 32 first turns of {env} "
        "train instances, so RL alone sees almost no reward spread (plain frozenlake: 0 -> 0% after "
        "15 steps, chance 9.2%); the warm-up row is this task's measurement"
    )


ROWS = [
    Row("arithmetic", "arithmetic, 2-digit addition (the demo)", "quickstart.yaml",
        ">= 80% in <= 10 min", target_after=0.80, max_minutes=10.0),
    Row("calculator-1op", "calculator, 1 operation", "env_calculator.yaml",
        ">= 90%, tool used in >= 95%", target_after=0.90, min_tool_rate=0.95),
    Row("calculator-2op", "calculator, 2 operations", "env_calculator.yaml", ">= 50%",
        target_after=0.50, overrides=("task.env.options.num_operations=2", "rollout.max_turns=4",
                                      "rollout.max_total_tokens=192")),
    Row("calculator-2op-curriculum", "calculator, 2 operations, via a 1 -> 2 curriculum",
        "env_calculator_curriculum.yaml", ">= 50%", target_after=0.50),
    Row("calculator-1op-warmup", "calculator, 1 operation; format warm-up (random operations on the "
        "question's numbers), then RL", "env_calculator_1op_warmup.yaml",
        ">= 90%, tool used in >= 95%", target_after=0.90, min_tool_rate=0.95, pipeline=True),
    Row("calculator-2op-warmup", "calculator, 2 operations; format warm-up (random expressions over "
        "every number), then RL", "env_calculator_2op_warmup.yaml", ">= 50%", target_after=0.50,
        pipeline=True),
    Row("bandit", "bandit", "env_bandit.yaml", "best arm >= 95%", target_after=0.95,
        overrides=HELDOUT_200),
    Row("bandit-warmup", "bandit; format warm-up (random arms), then RL", "env_bandit_warmup.yaml",
        "best arm >= 95%", target_after=0.95, overrides=HELDOUT_200, pipeline=True),
    # Behaviour cloning of the better arm on train payout tables (labelled as such): whether
    # SmolLM2-135M can learn to compare coins x probability from examples, and what RL adds.
    Row("bandit-solver-warmup", "bandit; solver warm-up (behaviour cloning of the better arm on "
        "train payout tables), then RL", "env_bandit_warmup.yaml", "best arm >= 95%",
        target_after=0.95, overrides=HELDOUT_200, pipeline=True,
        stage_overrides=("env_demos.policy=scripted",)),
    # The same cloning with the working written before the answer (bandit's `working` option:
    # "gold 5 x 90 = 450, silver 20 x 10 = 200, 450 > 200 <answer>gold</answer>"), ~46 tokens:
    # the one-word row above did not learn the rule even on its own demonstrations. RL samples at
    # temperature 0.7: at 1.0 (session 28) only 79% of the products its train samples wrote were
    # right, so its groups differed by sampling slips rather than by the rule, and RL lost 3.5 points.
    Row("bandit-solver-working-warmup", "bandit, products written before the answer; solver "
        "warm-up (behaviour cloning of the solver's working on train payout tables), then RL",
        "env_bandit_warmup.yaml", "best arm >= 95%", target_after=0.95,
        overrides=(*HELDOUT_200, "task.env.options.working=true", "sampling.max_new_tokens=64",
                   "rollout.max_total_tokens=96", "sampling.temperature=0.7"),
        pipeline=True, stage_overrides=("env_demos.policy=scripted",)),
    # The working row's RL with the working rewarded as well (bandit's `working` part, weight 0.5,
    # below the answer's 1.0): in that row's train samples (T 0.7, session 29) 241 of 673 successes
    # wrote a wrong product and 73 failures a right pair of products with the comparison turned the
    # wrong way, while 75-88% of groups were all-equal on the answer alone (1-2 informative groups
    # a step): scoring the working pays what makes an answer right and splits those groups.
    Row("bandit-solver-working-reward-warmup", "bandit, products written before the answer and "
        "rewarded (working 0.5); solver warm-up (behaviour cloning of the solver's working on "
        "train payout tables), then RL", "env_bandit_warmup.yaml", "best arm >= 95%",
        target_after=0.95,
        overrides=(*HELDOUT_200, "task.env.options.working=true", "sampling.max_new_tokens=64",
                   "rollout.max_total_tokens=96", "sampling.temperature=0.7",
                   "task.env.reward_weights.working=0.5"),
        pipeline=True, stage_overrides=("env_demos.policy=scripted",)),
    Row("frozenlake", "frozenlake 4x4, not slippery", "env_frozenlake.yaml", "+30 points",
        target_gain=0.30, overrides=HELDOUT_200),
    Row("frozenlake-warmup", "frozenlake 4x4, not slippery; format warm-up, then RL",
        "env_frozenlake_warmup.yaml", "+30 points", target_gain=0.30, overrides=HELDOUT_200,
        pipeline=True),
    Row("frozenlake-solver-warmup", "frozenlake 4x4, not slippery; solver warm-up (behaviour "
        "cloning of the scripted solver on train lakes), then RL", "env_frozenlake_warmup.yaml",
        "+30 points", target_gain=0.30, overrides=HELDOUT_200, pipeline=True,
        stage_overrides=("env_demos.policy=scripted",)),
    # The grid plus a line naming the player's and goal's cells and what each move steps onto
    # (frozenlake's `observation: positions`): cloning the solver on the grid alone left the move
    # loss high (~0.9 nats, a guess is 1.39). Same warm-up as the solver row's session-26 run
    # (512 demos, 8 turns, 96 steps). The positions line makes each turn ~2x longer, so the grid rows'
    # 400-token episode budget cut the solver's own paths (88.5% solved, random 5.8%, 3.3 turns); at
    # 720 the solver solves every held-out lake and the random walk gets 10.4% (the grid rows: 9.2%),
    # and the SFT stage's max_length (512) is raised to fit those demos.
    Row("frozenlake-positions-solver-warmup", "frozenlake 4x4, not slippery, positions stated in "
        "each observation; solver warm-up, then RL", "env_frozenlake_warmup.yaml", "+30 points",
        target_gain=0.30, overrides=(*HELDOUT_200, "task.env.options.observation=positions",
                   "rollout.max_total_tokens=720"),
        pipeline=True, stage_overrides=("env_demos.policy=scripted", "env_demos.episodes=512",
                                        "env_demos.max_turns=8", "config.train.steps=96",
                                        "config.train.max_length=768")),
    # The same with DART's noise injection in the solver's demonstrations (env_demos.noise): 30% of
    # the turns random legal moves, kept as untrained context, so the clone sees the solver recover
    # off its own path. Why: the plain clone, sampled at T 0.7, walked into the edge on 52% of its
    # later moves, 81% of them repeating its previous move (session 32, docs/efficacy_notes.md).
    Row("frozenlake-positions-dart-warmup", "frozenlake 4x4, not slippery, positions stated in "
        "each observation; solver warm-up with 30% noise turns (DART), then RL", "env_frozenlake_warmup.yaml",
        "+30 points", target_gain=0.30, overrides=(*HELDOUT_200, "task.env.options.observation=positions",
                                                  "rollout.max_total_tokens=720"),
        pipeline=True, stage_overrides=("env_demos.policy=scripted", "env_demos.episodes=512",
                                        "env_demos.max_turns=8", "env_demos.noise=0.3",
                                        # random turns lengthen a row past 768 tokens
                                        "config.train.steps=96", "config.train.max_length=1024")),
    Row("frozenlake-warmup-gigpo", "frozenlake 4x4, not slippery; format warm-up, then RL with GiGPO "
        "credit", "env_frozenlake_warmup.yaml", "+30 points", target_gain=0.30,
        overrides=(*HELDOUT_200, *GIGPO), pipeline=True),
    Row("frozenlake-warmup-turn", "frozenlake 4x4, not slippery; format warm-up, then RL with turn "
        "credit", "env_frozenlake_warmup.yaml", "+30 points", target_gain=0.30,
        overrides=(*HELDOUT_200, *TURN), pipeline=True),
    Row("frozenlake-slippery", "frozenlake 4x4, slippery", "env_frozenlake.yaml", "+15 points",
        target_gain=0.15, overrides=(*HELDOUT_200, "task.env.options.slippery=true"),
        not_run=no_format(2, "frozenlake")),
    Row("frozenlake-slippery-warmup", "frozenlake 4x4, slippery; format warm-up, then RL",
        "env_frozenlake_warmup.yaml", "+15 points", target_gain=0.15,
        overrides=(*HELDOUT_200, "task.env.options.slippery=true"), pipeline=True),
    Row("sokoban", "sokoban, smallest room (5x5, 1 box)", "env_sokoban.yaml", "+15 points",
        target_gain=0.15, overrides=SOKOBAN_5X5, not_run=no_format(0, "sokoban")),
    Row("sokoban-warmup", "sokoban, smallest room (5x5, 1 box); format warm-up, then RL",
        "env_sokoban_warmup.yaml", "+15 points", target_gain=0.15,
        overrides=SOKOBAN_5X5, pipeline=True),
    Row("sokoban-warmup-gigpo", "sokoban, smallest room (5x5, 1 box); format warm-up, then RL "
        "with GiGPO credit", "env_sokoban_warmup.yaml", "+15 points", target_gain=0.15,
        overrides=(*SOKOBAN_5X5, *GIGPO), pipeline=True),
    Row("sokoban-warmup-turn", "sokoban, smallest room (5x5, 1 box); format warm-up, then RL "
        "with turn credit", "env_sokoban_warmup.yaml", "+15 points", target_gain=0.15,
        overrides=(*SOKOBAN_5X5, *TURN), pipeline=True),
    Row("countdown", "countdown, 3 numbers", "env_countdown.yaml", "+15 points",
        target_gain=0.15, overrides=HELDOUT_200,
        not_run=no_format(2, "countdown")),
    Row("countdown-warmup", "countdown, 3 numbers; format warm-up, then RL",
        "env_countdown_warmup.yaml", "+15 points", target_gain=0.15, overrides=HELDOUT_200,
        pipeline=True),
    Row("sudoku", "sudoku 4x4", "env_sudoku.yaml", "+20 points", target_gain=0.20,
        overrides=HELDOUT_200,
        not_run=no_format(0, "sudoku")),
    Row("sudoku-warmup", "sudoku 4x4; format warm-up, then RL", "env_sudoku_warmup.yaml",
        "+20 points", target_gain=0.20, overrides=HELDOUT_200, pipeline=True),
    # Behaviour cloning of the solved grid (the solver's one answer) on 512 train puzzles, one pass
    # over them (128 steps of 4): the random warm-up's grids are almost never valid, so its RL saw no
    # success to learn from (0.0% -> 0.0%). Held-out puzzles have answer grids no train puzzle has
    # (sudoku's split_key), so the clone cannot recall an answer: it has to fill the blanks.
    Row("sudoku-solver-warmup", "sudoku 4x4; solver warm-up (behaviour cloning of solved train "
        "puzzles), then RL", "env_sudoku_warmup.yaml", "+20 points", target_gain=0.20,
        overrides=HELDOUT_200, pipeline=True,
        stage_overrides=("env_demos.policy=scripted", "env_demos.episodes=512",
                         "config.train.steps=128")),
    # The same warm-up with three passes over the same 512 demonstrations (384 steps of 4): chosen on
    # 200 unseen TRAIN puzzles (docs/efficacy_notes.md, sudoku solver section), where it solved 50.5%
    # against 14.5% after one pass and changed a given in 47.5% of first answers against 83.5%.
    Row("sudoku-solver3-warmup", "sudoku 4x4; solver warm-up, three passes, then RL",
        "env_sudoku_warmup.yaml", "+20 points", target_gain=0.20,
        overrides=HELDOUT_200, pipeline=True,
        stage_overrides=("env_demos.policy=scripted", "env_demos.episodes=512",
                         "config.train.steps=384")),
    # Trains on the env's 50 tasks, held out: the 118 HumanEval problems that convert strictly and
    # repeat none of them (rlvr.envs.humaneval; 24 bundled tasks held out before, too few: 0/24 allows
    # a true 14%). HumanEval prompts run to 410 tokens: 1024 holds one and two 256-token answers.
    Row("code", "code: HumanEval (118 problems), trained on the env's 50 tasks", "env_code.yaml",
        "+10 points pass@1", target_gain=0.10,
        overrides=("task.env.options.eval_set=humaneval", *HELDOUT_200,
                   "rollout.max_total_tokens=1024")),
]  # fmt: skip
BY_NAME = {r.name: r for r in ROWS}


def cpu_kind() -> str:
    """`lscpu`'s model name and whether it has native bf16 (what `model.bf16: auto` reads)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    bf16 = "avx512_bf16" in fields.get("Flags", "") or "amx_bf16" in fields.get("Flags", "")
    return f"{name}, {fields.get('CPU(s)', '?').strip()} cores, {'' if bf16 else 'no '}avx512_bf16"


def paired_bootstrap_ci(
    before: list[float], after: list[float], resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile interval of mean(after - before) over instances resampled with replacement."""
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def per_instance_scores(policy: Any, cfg: Any, config_dir: Path, n: int, k: int) -> dict[str, Any]:
    """Greedy pass@1 per held-out instance, mean@k, tool-call rate and turns (greedy episodes)."""
    from rlvr.build import build_generator, rollout_limits
    from rlvr.records import flatten
    from rlvr.rollout.engine import rollout_groups
    from rlvr.rollout.generator import SamplingParams
    from rlvr.train.sources import Sources

    sources = Sources(cfg, config_dir)
    if sources.is_mixture:
        raise SystemExit("efficacy rows are single-source configs")
    (source,) = list(sources)
    tasks = source.splits.heldout[:n]
    generator = build_generator(policy, cfg)
    limits = rollout_limits(cfg)
    max_new = cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens
    stop = tuple(cfg.sampling.stop)

    def play(k_: int, temperature: float) -> list[Any]:
        sampling = SamplingParams(n=k_, temperature=temperature, max_new_tokens=max_new, stop=stop)
        return rollout_groups(
            tasks, source.make_env, generator, policy.tokenizer, sampling, source.scoring, limits
        )

    greedy = play(1, 0.0)
    passed = [float(g.trajectories[0].rewards.get(source.metric, 0.0) >= 1.0) for g in greedy]
    trajectories = flatten(greedy)
    out: dict[str, Any] = {
        "n": len(tasks),
        "ids": [t.id for t in tasks],
        "pass1": passed,
        "tool_call_rate": statistics.fmean(
            float(t.info.get("tool_calls", 0) > 0) for t in trajectories
        ),
        "turns": statistics.fmean(len(t.turns) for t in trajectories),
        "errors": sum(not t.usable for t in trajectories),
    }
    if k > 1:
        sampled = flatten(play(k, cfg.sampling.temperature))
        out[f"mean@{k}"] = statistics.fmean(
            float(t.rewards.get(source.metric, 0.0) >= 1.0) for t in sampled
        )
    return out


def score_base(model: str, cfg: Any, n: int, k: int) -> dict[str, Any]:
    """per_instance_scores of the base model (what the cache stands in for)."""
    from rlvr.models import load_policy

    return per_instance_scores(load_policy(model), cfg, EXAMPLES, n, k)


def base_scores(row: Row, cfg: Any, model: str, n: int, k: int, cache: Any) -> tuple[dict, str]:
    """The base model's per-instance scores, from `cache` (a base_cache.Cache) when stored under
    their key, and how they were had (`cached (<key prefix>)` or `scored (...)`)."""
    # One base model whatever seed the run trains with: score it (and key its cache) under seed 0
    # (the sampled mean@k's seed), so the seeds of a row share one `before`.
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"seed": 0})})
    source = inspect.getsource(per_instance_scores)
    key = base_cache.base_key(cfg, model, n, k, EXAMPLES, source, cpu_kind())
    print(f"[{row.name}] base model on {n} held-out instances...", flush=True)
    before, how = base_cache.cached_base(
        row.name, key, k, cache, lambda: score_base(model, cfg, n, k)
    )
    print(f"[{row.name}] base: {how}", flush=True)
    print(f"[{row.name}] before: pass@1 {statistics.fmean(before['pass1']):.1%}", flush=True)
    return before, how


# What every RL run of a row is told, whatever the config says: no in-run evals, no step
# checkpoints, the row's time budget.
RL_RUN_OVERRIDES = ("eval.at_start=false", "eval.at_end=false", "eval.every=0",
                    "checkpoint.every=0", "tracking.progress=false")  # fmt: skip


def measure(
    row: Row,
    budget_minutes: float,
    n: int,
    k: int,
    runs_dir: Path,
    extra: list[str],
    cache: Any = None,
) -> dict[str, Any]:
    """Before, train, after for one row; `extra` are more `--set` overrides (tests use a tiny model);
    `cache`: the base results' base_cache.Cache (None: not cached)."""
    from rlvr.config import load_config
    from rlvr.evaluate_cli import load_model
    from rlvr.train.loop import train

    config_path = EXAMPLES / row.config
    run_dir = runs_dir / row.name
    overrides = [
        *row.overrides,
        f"output_dir={run_dir}",
        *RL_RUN_OVERRIDES,
        f"train.time_limit_minutes={budget_minutes}",
        *extra,
    ]
    cfg = load_config(config_path, overrides)
    recipe = config_sha(row)  # the files as this run reads them, not as they are when it ends
    before, how = base_scores(row, cfg, cfg.model.name, n, k, cache)
    started = time.time()
    steps = train(cfg, config_dir=EXAMPLES, overwrite=True).steps_done
    wall = (time.time() - started) / 60
    policy, _ = load_model(str(run_dir))
    after = per_instance_scores(policy, cfg, EXAMPLES, n, k)
    args = "".join(f" --set {e}" for e in extra)
    return row_result(
        row, cfg, before, after, steps, wall, budget_minutes, k, n, args, how, recipe,
        trained=run_dir,
    )  # fmt: skip


def config_sha(row: Row) -> str:
    """sha256 over the row's example config and the stage files it names (a warm-up pipeline's
    `file: env_x.yaml`), in order: what its recipe is beyond its overrides and command. Over the
    parsed YAML, so an edited comment leaves a series whole and an edited value splits it."""
    import hashlib

    import yaml

    path = EXAMPLES / row.config
    files = [path]
    if row.pipeline:
        stages = yaml.safe_load(path.read_text()).get("stages", [])
        files += [EXAMPLES / s["file"] for s in stages if isinstance(s, dict) and s.get("file")]
    recipe = [[file.name, yaml.safe_load(file.read_text())] for file in files]
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()


def row_result(
    row: Row,
    cfg: Any,
    before: dict[str, Any],
    after: dict[str, Any],
    steps: int,
    wall: float,
    budget_minutes: float,
    k: int,
    n: int,
    extra_args: str,
    base: str,
    recipe_sha: str,
    trained: Path | None = None,
) -> dict[str, Any]:
    """The JSONL object of one measured row (a warm-up row adds its own keys to it)."""
    low, high = paired_bootstrap_ci(before["pass1"], after["pass1"])
    acc_before, acc_after = statistics.fmean(before["pass1"]), statistics.fmean(after["pass1"])
    result = {
        "row": row.name,
        "task": row.task,
        "config": f"examples/{row.config}",
        "overrides": list(row.overrides),
        "config_sha": recipe_sha,  # config_sha(row) when the run started
        "n": before["n"],
        "before": acc_before,
        "after": acc_after,
        "gain": acc_after - acc_before,
        "gain_ci95": [low, high],
        f"mean@{k}_before": before.get(f"mean@{k}"),
        f"mean@{k}_after": after.get(f"mean@{k}"),
        "k": k,
        "tool_call_rate_after": after["tool_call_rate"],
        "turns_after": after["turns"],
        "eval_errors_after": after["errors"],
        "base": base,
        "steps": steps,
        "train_minutes": wall,
        "budget_minutes": budget_minutes,
        "seed": cfg.train.seed,  # the RL run's (rows measured on several seeds: _efficacy_seeds.py)
        "cpu": cpu_kind(),
        "precision": precision_text(cfg, trained),
        "date": time.strftime("%Y-%m-%d"),
        "target": row.target,
        "met": met(row, acc_before, acc_after, wall, after["tool_call_rate"]),
        "command": f"python benchmarks/efficacy.py --rows {row.name} "
        f"--budget-minutes {budget_minutes:g} --n {n} --k {k}" + extra_args,
    }
    result["recipe"] = recipe_of(cfg)
    if trained is not None and (trained / "metrics.jsonl").exists():
        result["per_step"] = per_step_signal(trained)
        result["recipe"]["episodes"] = sum(s.get("signal/episodes", 0) for s in result["per_step"])
    if "ids" in after:  # per instance, so any interval (against chance too) can be recomputed
        result["heldout_sha"] = chance_lib.ids_sha(list(after["ids"]))
        result["per_instance"] = {"ids": after["ids"], "before": before["pass1"],
                                  "after": after["pass1"]}  # fmt: skip
    print(f"[{row.name}] {json.dumps(result)}", flush=True)
    return result


# What every RL step of a row's run stores beside its result (issue 62): whether it carried signal.
STEP_SIGNAL = ("learning_rate", "lr_horizon_steps", "reward", "grad_norm", "entropy",
               "update/relative_norm", "update/no_signal", "rollout/filter_kept_ratio",
               "step_time")  # fmt: skip


def per_step_signal(run_dir: Path) -> list[dict[str, Any]]:
    """One entry per RL step of the run in `run_dir` (its metrics.jsonl): the step, its signal/*
    metrics (episodes, successes, groups with a reward / success contrast, kept groups and their
    all-equal share) and STEP_SIGNAL (lr in force, update norm relative to the weights, ...)."""
    from rlvr.observe.tracking import read_metrics

    out = []
    for m in read_metrics(run_dir):
        if "step_time" not in m:  # eval rows and alert events
            continue
        entry = {"step": m["step"]}
        entry.update({k: v for k, v in m.items() if k.startswith("signal/") or k in STEP_SIGNAL})
        out.append(entry)
    return out


def recipe_of(cfg: Any) -> dict[str, Any]:
    """The RL recipe a row ran with, for the table: lr, beta, schedule, episodes per step."""
    return {
        "learning_rate": cfg.train.learning_rate,
        "beta": cfg.objective.beta,
        "lr_schedule": cfg.train.lr_schedule,
        "scale_rewards": cfg.objective.scale_rewards,
        "credit": cfg.objective.credit,
        "placebo": cfg.objective.placebo,
        "episodes_per_step": cfg.sampling.group_size * cfg.sampling.prompts_per_step,
    }


def precision_text(cfg: Any, trained: Path | None = None) -> str:
    """The row's precision column: the update's, plus the sampling copy's when rlvr's decode path
    (`decode: fast`, or `auto` resolving to it) samples from a bf16 copy of the weights (learning
    under it is what such a row measures).
    `trained`: the RL run's directory, whose `perf/precision` says what `model.bf16: auto` measured
    (a warm-up row's RL stage trains a model whose name the row's config does not hold)."""
    from rlvr.build import use_bf16
    from rlvr.config import bf16_sampling_copy, decode_path
    from rlvr.observe.tracking import read_metrics

    update = "bf16 autocast" if use_bf16(cfg.model) else "fp32"
    rows = read_metrics(trained) if trained and (trained / "metrics.jsonl").exists() else []
    logged = [m["perf/precision"] for m in rows if "perf/precision" in m]
    if logged:
        update = "bf16 autocast" if logged[-1] == 16 else "fp32"
    gen = cfg.generator
    if decode_path(gen.backend, gen.decode, gen.decode_dtype, cfg.model.bf16) != "fast":
        return update
    copy_bf16 = bf16_sampling_copy(gen.backend, gen.decode, gen.decode_dtype, cfg.model.bf16)
    return f"{update}; sampling: own decode, {'bf16' if copy_bf16 else 'fp32'} copy"


def measure_warmup(
    row: Row,
    budget_minutes: float,
    n: int,
    k: int,
    runs_dir: Path,
    extra: list[str],
    warmup_extra: list[str],
    cache: Any = None,
    warmup_from: Path | None = None,
    warmup_only: bool = False,
    known_warm: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """A warm-up row: the pipeline's stages before its RL stage, timed; then the RL stage with the
    rest of the budget; the base, the warm-up's model and the end scored on the same held-out
    instances. `extra` goes to the RL stage (`model.name=` is the pipeline's start model and other
    `model.*` keys go to every stage); `warmup_extra` to the stages before it. Only the base's
    scores come from `cache`; the warm-up's model is always scored.

    `warmup_from`: the run directory of an earlier `warmup_only` run of this row: its finished
    warm-up stages are reused (their markers copied; the models stay where they are), so several
    RL seeds and their placebo arms start from one and the same clone. `warmup_only`: run the
    warm-up stages into the run directory and stop (returns None). `known_warm`: the warm-up
    model's scores already measured (a placebo arm from its real arm's clone and seed)."""
    from rlvr.evaluate_cli import load_model
    from rlvr.models import load_policy
    from rlvr.observe.tracking import read_metrics
    from rlvr.pipeline import first_rl_config, load_pipeline_config, run_pipeline

    path = EXAMPLES / row.config
    warmup_demos = [e for e in warmup_extra if e.startswith("env_demos.")]
    warmup_config = [e for e in warmup_extra if not e.startswith("env_demos.")]
    if warmup_demos and not any(s.env_demos for s in load_pipeline_config(path).stages):
        raise SystemExit(f"--warmup-set {warmup_demos[0]}: {row.config} has no env_demos stage")
    run_dir = runs_dir / row.name
    if run_dir.exists():  # a fresh measurement: finished stages of an old one must not be reused
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
    if warmup_from is not None:
        reuse_warmup(warmup_from, run_dir)
    start_model = [e.split("=", 1)[1] for e in extra if e.startswith("model.name=")]
    rl_extra = [e for e in extra if not e.startswith("model.name=")]
    every_stage = [e for e in rl_extra if e.startswith("model.")]  # e.g. model.bf16

    def load(rl_minutes: float) -> Any:
        stages = load_pipeline_config(path).stages
        rl = next(i for i, s in enumerate(stages) if s.kind == "rl")
        sets = [
            f"output_dir={run_dir}",
            "eval.each_stage=false",
            *(f"model={m}" for m in start_model),
        ]
        for i in range(rl):
            sets += [
                f"stages.{i}.config.{e}" for e in ("progress=false", *every_stage, *warmup_config)
            ]
            sets += [f"stages.{i}.{e}" for e in row.stage_overrides]
            if stages[i].env_demos:  # env_demos.* keys: how the warm-up's demonstrations play
                sets += [f"stages.{i}.{e}" for e in warmup_demos]
        rl_sets = [*row.overrides, *RL_RUN_OVERRIDES, f"train.time_limit_minutes={rl_minutes}",
                   *rl_extra]  # fmt: skip
        return load_pipeline_config(path, sets + [f"stages.{rl}.config.{e}" for e in rl_sets]), rl

    cfg, rl = load(budget_minutes)
    recipe = config_sha(row)  # the files as this run first reads them
    rl_name = cfg.stages[rl].name
    rl_cfg = first_rl_config(cfg, EXAMPLES)
    assert rl_cfg is not None
    before, how = base_scores(row, rl_cfg, cfg.model, n, k, cache)
    warm_rows = run_pipeline(cfg, config_dir=EXAMPLES, stop_before=rl_name)
    if warmup_only:
        print(f"[{row.name}] warm-up done: --warmup-from {run_dir}", flush=True)
        return None
    warm_minutes = sum(r.get("wall_minutes", 0.0) for r in warm_rows)
    warm = known_warm or per_instance_scores(
        load_policy(warm_rows[-1]["model_dir"]), rl_cfg, EXAMPLES, n, k
    )
    print(f"[{row.name}] after warm-up: pass@1 {statistics.fmean(warm['pass1']):.1%}", flush=True)
    cfg, _ = load(max(budget_minutes - warm_minutes, 1.0))
    rl_row = run_pipeline(cfg, config_dir=EXAMPLES)[-1]
    policy, _ = load_model(str(run_dir / rl_name))
    after = per_instance_scores(policy, rl_cfg, EXAMPLES, n, k)
    # Every RL step (one with no signal has no loss: it took no optimizer step).
    steps = max((m["step"] for m in read_metrics(run_dir / rl_name) if "step_time" in m), default=0)
    args = "".join(f" --set {e}" for e in extra) + "".join(
        f" --warmup-set {e}" for e in warmup_extra
    )
    wall = warm_minutes + rl_row["wall_minutes"]
    result = row_result(
        row, rl_cfg, before, after, steps, wall, budget_minutes, k, n, args, how, recipe,
        trained=run_dir / rl_name,
    )  # fmt: skip
    low, high = paired_bootstrap_ci(warm["pass1"], after["pass1"])
    acc_warm = statistics.fmean(warm["pass1"])
    if "per_instance" in result:
        result["per_instance"]["after_warmup"] = warm["pass1"]
    result.update({
        "after_warmup": acc_warm,
        f"mean@{k}_after_warmup": warm.get(f"mean@{k}"),
        "rl_gain": result["after"] - acc_warm,
        "rl_gain_ci95": [low, high],
        "warmup_minutes": warm_minutes,
        "warmup_metrics": {key: v for r in warm_rows[1:] for key, v in r["metrics"].items()},
    })  # fmt: skip
    print(f"[{row.name}] {json.dumps(result)}", flush=True)
    return result


PLACEBO = "objective.placebo=shuffle_within_group"


def warm_of(result: dict[str, Any]) -> dict[str, Any]:
    """A warm-up row's scores of its warm-up model, as per_instance_scores gave them."""
    k = result["k"]
    return {"pass1": result["per_instance"]["after_warmup"],
            f"mean@{k}": result.get(f"mean@{k}_after_warmup")}  # fmt: skip


def attach_placebo(result: dict[str, Any], placebo: dict[str, Any]) -> dict[str, Any]:
    """The real arm's result with its placebo arm (same row, seed and warm-up, rewards shuffled
    within groups) folded in: the placebo's after, per instance, and the real arm's gain over it
    with a paired 95% interval over instances: what the reward itself taught."""
    k = result["k"]
    real_after, placebo_after = result["per_instance"]["after"], placebo["per_instance"]["after"]
    if result["per_instance"]["ids"] != placebo["per_instance"]["ids"]:
        raise SystemExit(f"[{result['row']}] placebo arm scored other instances than the real arm")
    low, high = paired_bootstrap_ci(placebo_after, real_after)
    result["per_instance"]["after_placebo"] = placebo_after
    result["placebo"] = {key: placebo.get(key) for key in
                         ("after", f"mean@{k}_after", "steps", "train_minutes", "per_step",
                          "recipe", "command")}  # fmt: skip
    result["after_placebo"] = placebo["after"]
    result[f"mean@{k}_after_placebo"] = placebo.get(f"mean@{k}_after")
    result["over_placebo"] = result["after"] - placebo["after"]
    result["over_placebo_ci95"] = [low, high]
    result["command"] += " --placebo"
    print(
        f"[{result['row']}] RL over placebo {result['over_placebo']:+.3f} ({low:+.3f}, {high:+.3f})"
    )
    return result


def reuse_warmup(source: Path, run_dir: Path) -> None:
    """Start `run_dir` with the finished warm-up stages of `source` (a `--warmup-only` run of the
    same row): its pipeline.json and each finished stage's marker, which names the stage's model
    where it lies in `source`; the pipeline then skips those stages ("done earlier")."""
    from rlvr.pipeline import DONE_FILE

    markers = sorted(source.glob(f"*/{DONE_FILE}"))
    if not (source / "pipeline.json").exists() or not markers:
        raise SystemExit(f"--warmup-from {source}: no finished warm-up stage there")
    run_dir.mkdir(parents=True)
    (run_dir / "pipeline.json").write_text((source / "pipeline.json").read_text())
    for marker in markers:
        (run_dir / marker.parent.name).mkdir()
        (run_dir / marker.parent.name / DONE_FILE).write_text(marker.read_text())


def met(
    row: Row,
    before: float,
    after: float,
    minutes: float,
    tool_rate: float,
    over_chance: tuple[float, float, float] | None = None,
) -> bool:
    """Whether the row's target holds on the measured numbers: a held-out level reached (within
    its time and tool-use conditions), or a held-out gain of at least the asked points.

    `over_chance`: (gain over the random legal policy, its 95% interval) where the env has one.
    Then a gain is counted over chance, not over the untrained model (which may not even write
    the answer format), and either kind of target also needs the interval to exclude 0: a level
    reached by a policy no better than random moves is not a learned task."""
    if row.max_minutes is not None and minutes > row.max_minutes:
        return False
    if row.min_tool_rate is not None and tool_rate < row.min_tool_rate:
        return False
    if over_chance is not None and over_chance[1] <= 0.0:
        return False
    if row.target_after is not None:
        return after >= row.target_after
    assert row.target_gain is not None
    gain = over_chance[0] if over_chance is not None else after - before
    return gain >= row.target_gain


# Random episodes per held-out instance for the chance column (the solver plays each once).
CHANCE_EPISODES = 8


def row_rl_config(row: Row) -> Any:
    """The RL config a row scores with (a warm-up row's RL stage), with the row's overrides."""
    from rlvr.config import load_config
    from rlvr.pipeline import first_rl_config, load_pipeline_config

    path = EXAMPLES / row.config
    if not row.pipeline:
        return load_config(path, list(row.overrides))
    stages = load_pipeline_config(path).stages
    rl = next(i for i, s in enumerate(stages) if s.kind == "rl")
    sets = [f"stages.{rl}.config.{o}" for o in row.overrides]
    return first_rl_config(load_pipeline_config(path, sets), EXAMPLES)


@functools.cache
def is_env(name: str) -> bool:
    """Whether the row plays an env (a random legal policy to measure), not a dataset task."""
    return bool(row_rl_config(BY_NAME[name]).task.source == "env")


def measure_chance(row: Row, n: int, episodes: int, memo: dict[str, list]) -> list[dict]:
    """The chance (random legal policy) and solver records of one row; rows that play the same
    held-out instances under the same limits share one measurement (`memo`)."""
    import dataclasses

    from rlvr.build import rollout_limits

    if not is_env(row.name):
        return []
    cfg = row_rl_config(row)
    key = json.dumps(
        [cfg.task.model_dump(mode="json"), dataclasses.asdict(rollout_limits(cfg)),
         cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens, cfg.model.name, n, episodes],
        sort_keys=True, default=str,
    )  # fmt: skip
    if key not in memo:
        old = chance_lib.id_split_sha(cfg, n)
        memo[key] = []
        for policy in ("random", "scripted"):
            print(f"[{row.name}] {policy} policy on {n} held-out instances...", flush=True)
            record = chance_lib.policy_scores(cfg, EXAMPLES, n, policy, episodes)
            record.update({
                "id_split_sha": old,
                "date": time.strftime("%Y-%m-%d"),
                "cpu": cpu_kind(),
                "command": f"python benchmarks/efficacy.py --chance-only --rows {row.name} "
                f"--n {n} --chance-episodes {episodes}",
            })  # fmt: skip
            memo[key].append(record)
    records = [{"row": row.name, **r} for r in memo[key]]
    for r in records:
        if not r.get("absent"):
            print(
                f"[{row.name}] {r['policy']}: {r['success']:.1%} ({r['seconds']:.0f} s)", flush=True
            )
    return records


def render(results: list[dict[str, Any]], chance: list[dict[str, Any]] | None = None) -> str:
    """docs/efficacy.md from the newest result and chance / solver record of every row."""
    return efficacy_table.render(ROWS, met, is_env, CHANCE_EPISODES, results, chance)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=[r.name for r in ROWS])
    parser.add_argument("--budget-minutes", type=float, default=30.0)
    parser.add_argument("--n", type=int, default=200, help="held-out instances (all if fewer)")
    parser.add_argument("--k", type=int, default=4, help="samples per instance for mean@k")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "efficacy")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "efficacy.jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "efficacy.md")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument(
        "--set", dest="extra", action="append", default=[], help="more overrides (key=value)"
    )
    parser.add_argument(
        "--warmup-set",
        dest="warmup_extra",
        action="append",
        default=[],
        help="overrides of a warm-up row's stages before RL: their config (e.g. train.steps=8), "
        "or env_demos.KEY (e.g. env_demos.episodes=512) of the stage that plays demonstrations",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="measure each row once per seed (train.seed of every stage); the table shows the "
        "mean over the row's seeds and their spread",
    )
    parser.add_argument(
        "--warmup-only",
        action="store_true",
        help="warm-up rows: run the stages before RL into --runs-dir and stop (for --warmup-from)",
    )
    parser.add_argument(
        "--warmup-from",
        type=Path,
        help="warm-up rows: reuse the finished warm-up stages of this --warmup-only run directory, "
        "so every seed (and placebo arm) trains RL from one clone",
    )
    parser.add_argument(
        "--placebo",
        action="store_true",
        help="after each real run, a placebo arm from the same warm-up and seed with rewards "
        "shuffled within groups (objective.placebo); the table shows RL over placebo",
    )
    parser.add_argument("--base-cache", type=Path, help="default: efficacy-cache by --runs-dir")
    parser.add_argument("--no-base-cache", action="store_true", help="score the base model again")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite --out from --results, measure nothing"
    )
    parser.add_argument(
        "--chance-only",
        action="store_true",
        help="measure only the chance (random legal policy) and solver columns of --rows: no model",
    )
    parser.add_argument(
        "--chance-results", type=Path, default=ROOT / "benchmarks" / "efficacy_chance.jsonl"
    )
    parser.add_argument("--chance-episodes", type=int, default=CHANCE_EPISODES)
    args = parser.parse_args()
    if args.list:
        for row in ROWS:
            print(f"{row.name:22} {row.task} ({row.config} {' '.join(row.overrides)})")
        return
    unknown = [name for name in args.rows if name not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; --list shows them")
    if args.chance_only:
        memo: dict[str, list] = {}
        for name in args.rows:
            records = measure_chance(BY_NAME[name], args.n, args.chance_episodes, memo)
            with args.chance_results.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    elif not args.render_only:
        where = args.base_cache or args.runs_dir.parent / "efficacy-cache"
        cache = base_cache.Cache(where, refresh=args.no_base_cache)
        for name in args.rows:
            row = BY_NAME[name]
            for seed in args.seeds or [None]:
                # Each seed is a run of its own, in its own directory (its train metrics are
                # what says why seeds differ); the table averages a row's series of seeds.
                seeded = [] if seed is None else [f"train.seed={seed}"]
                runs = args.runs_dir if seed is None else args.runs_dir / f"seed-{seed}"
                extra = [*args.extra, *seeded]
                measure_args = (row, args.budget_minutes, args.n, args.k, runs, extra)
                if (args.warmup_only or args.warmup_from) and not row.pipeline:
                    raise SystemExit(f"--warmup-only/--warmup-from: {name} is not a warm-up row")
                if args.warmup_only:
                    measure_warmup(*measure_args, args.warmup_extra, cache, warmup_only=True)
                    break  # one clone, whatever the seeds
                warmup_args = [*args.warmup_extra, *seeded]
                result = (
                    measure_warmup(*measure_args, warmup_args, cache, args.warmup_from)
                    if row.pipeline
                    else measure(*measure_args, cache)
                )
                assert result is not None
                if args.warmup_from is not None:
                    result["command"] += f" --warmup-from {args.warmup_from}"
                if args.placebo:
                    arm = (row, args.budget_minutes, args.n, args.k, runs / "placebo",
                           [*extra, PLACEBO])  # fmt: skip
                    placebo = (
                        measure_warmup(
                            *arm,
                            warmup_args,
                            cache,
                            args.warmup_from or runs / name,
                            known_warm=warm_of(result),
                        )
                        if row.pipeline
                        else measure(*arm, cache)
                    )
                    assert placebo is not None
                    result = attach_placebo(result, placebo)
                with args.results.open("a") as f:
                    f.write(json.dumps(result) + "\n")
                args.out.write_text(
                    render(read_jsonl(args.results), read_jsonl(args.chance_results))
                )
    args.out.write_text(render(read_jsonl(args.results), read_jsonl(args.chance_results)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
