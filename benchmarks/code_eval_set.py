"""The code env's HumanEval held-out set, checked whole through the real sandbox (rlvr.envs.humaneval).

    python benchmarks/code_eval_set.py      # ~2-4 min on 2 cores; prints the counts, exits 1 on a problem

- conversion: how many of HumanEval's 164 problems convert, why the rest do not, which are dropped
  as repeats of a train task (by name, or SAME_AS_TRAIN);
- every kept problem's canonical solution passes its converted tests (the env's scripted solver);
- no repeat by solution, both ways: no converted problem's canonical solution (dropped ones
  included, so the check sees what SAME_AS_TRAIN removed) passes every test of a train task, and no
  train task's reference solution passes every test of a converted problem that is kept. Each pair whose arities
  match runs once, with a 2 s limit (a solution that times out on the other's inputs does not pass
  them). tests/test_code_eval_set.py runs the same on a fixed sample of 15 problems.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlvr.envs.code import load_code_tasks
from rlvr.envs.humaneval import convert, humaneval_specs, load_humaneval, repeats_train
from rlvr.sandbox import SandboxLimits, TestCase, run_tests

PAIR_WALL_SECONDS = 2.0


def arity(spec: Mapping[str, Any]) -> int | None:
    """The number of arguments every test of `spec` passes (None when they differ)."""
    counts = {len(t["args"]) for t in [*spec["tests"], *spec["hidden"]]}
    return counts.pop() if len(counts) == 1 else None


def passes_all(solution: str, entry: str, spec: Mapping[str, Any]) -> bool:
    """Whether `solution` (defining `entry`) passes every test of `spec`, called under its name."""
    code = f"{solution}\n\n{spec['entry']} = {entry}\n" if entry != spec["entry"] else solution
    cases = [TestCase(tuple(t["args"]), t["expected"]) for t in [*spec["tests"], *spec["hidden"]]]
    result = run_tests(
        code, str(spec["entry"]), cases, SandboxLimits(wall_seconds=PAIR_WALL_SECONDS)
    )
    return bool(result.all_passed)


def repeats_by_solution(
    solved: list[Mapping[str, Any]], solvers: list[Mapping[str, Any]], workers: int = 2
) -> list[tuple[str, str]]:
    """(solver, solved) names where a solver's solution passes every test of a spec of `solved`
    with the same arity."""
    pairs = [
        (a, b)
        for a in solvers
        for b in solved
        if a["name"] != b["name"] and arity(a) is not None and arity(a) == arity(b)
    ]
    with ThreadPoolExecutor(workers) as pool:
        hits = pool.map(lambda p: passes_all(p[0]["solution"], p[0]["entry"], p[1]), pairs)
        return [(a["name"], b["name"]) for (a, b), hit in zip(pairs, hits, strict=True) if hit]


def main() -> int:
    started = time.time()
    train = [dict(s) for s in load_code_tasks()]
    entries = tuple(s["entry"] for s in train)
    problems = load_humaneval()
    converted = [c for c in map(convert, problems) if isinstance(c, dict)]
    skipped = Counter(c.split(":")[0] for c in map(convert, problems) if isinstance(c, str))
    repeats = {s["name"]: repeats_train(s, entries) for s in converted}
    kept = list(humaneval_specs(entries))
    print(
        f"HumanEval: {len(problems)} problems, {len(converted)} convert; skipped: {dict(skipped)}"
    )
    print(
        f"dropped as repeats of a train task: {', '.join(f'{k} ({v})' for k, v in repeats.items() if v)}"
    )
    print(f"held-out set: {len(kept)} problems")

    with ThreadPoolExecutor(2) as pool:
        ok = list(pool.map(lambda s: passes_all(s["solution"], s["entry"], s), kept))
    failing = [s["name"] for s, passed in zip(kept, ok, strict=True) if not passed]
    print(
        f"canonical solutions passing their converted tests: {sum(ok)}/{len(kept)} {failing or ''}"
    )

    forward = repeats_by_solution(train, converted)
    backward = repeats_by_solution(converted, train)
    print(f"converted canonical solutions passing a train task's tests: {forward}")
    print(f"train reference solutions passing a converted problem's tests: {backward}")
    unlisted = [(he, t) for he, t in forward if not repeats[he]]
    unlisted += [(t, he) for t, he in backward if not repeats[he]]
    problems_found = bool(failing or unlisted or len(kept) < 100)
    print(f"{'PROBLEM' if problems_found else 'ok'} ({time.time() - started:.0f} s)")
    return 1 if problems_found else 0


if __name__ == "__main__":
    sys.exit(main())
