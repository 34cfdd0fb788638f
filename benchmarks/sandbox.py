"""Sandbox throughput: executions per second of a trivial passing program, and the sandbox's
overhead against a bare `python -c` subprocess, side by side in one run. "one sandbox run" is
runner.run_tests (what issue 17 measured: ~12/s on 2 workers before the isolation of issue 17);
"visible + hidden" is rlvr.sandbox.run_tests, which runs hidden tests in a second sandbox.

    python benchmarks/sandbox.py [--n 40] [--workers 2]
    python benchmarks/sandbox.py --adversarial     # tests/test_sandbox.py's hostile programs, timed
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from rlvr.sandbox import TestCase, capabilities, run_tests
from rlvr.sandbox.runner import run_tests as one_run

PROGRAM = "def solve(x):\n    return 2 * x\n"
TESTS = [TestCase((1,), 2), TestCase((5,), 10, hidden=True)]


def sandboxed() -> None:
    result = one_run(PROGRAM, "solve", TESTS)
    if not result.all_passed:
        raise RuntimeError(f"the trivial program did not pass: {result.outcomes} {result.stderr}")


def suite() -> None:
    result = run_tests(PROGRAM, "solve", TESTS)
    if not result.all_passed:
        raise RuntimeError(f"the trivial program did not pass: {result.outcomes} {result.stderr}")


def bare() -> None:
    code = PROGRAM + "assert solve(1) == 2 and solve(5) == 10\n"
    subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True)


def rate(fn: object, n: int, workers: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda _: fn(), range(n)))  # type: ignore[operator]
    return n / (time.perf_counter() - started)


def adversarial_table() -> None:
    """One row per hostile program: reward, what the first test saw, seconds (2 s deadline)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from rlvr.sandbox import SandboxLimits
    from test_sandbox import HOSTILE, WALL  # type: ignore[import-not-found]
    from test_sandbox import TESTS as HOSTILE_TESTS

    print("| case | reward | outcome (first test) | seconds |\n|---|---|---|---|")
    for name, code in HOSTILE.items():
        started = time.perf_counter()
        result = one_run(code, "solve", HOSTILE_TESTS, SandboxLimits(wall_seconds=WALL))
        seconds = time.perf_counter() - started
        seen = (result.load_error or result.outcomes[0]).replace("|", "/")[:60]
        if result.timed_out:
            seen = "killed at deadline; " + seen
        print(f"| {name} | {int(result.all_passed)} | {seen} | {seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--adversarial", action="store_true")
    args = parser.parse_args()
    print(f"isolation: {capabilities()}")
    if args.adversarial:
        adversarial_table()
        return
    sandboxed()  # the first run starts the zygote and probes the host: not part of the rate
    sandbox_rate = rate(sandboxed, args.n, args.workers)
    suite_rate = rate(suite, args.n, args.workers)
    bare_rate = rate(bare, args.n, args.workers)
    print(f"{'':34}{'exec/s':>10}{'ms/exec':>10}")
    print(f"{'rlvr sandbox, one run':34}{sandbox_rate:10.1f}{1000 / sandbox_rate:10.1f}")
    print(f"{'run_tests: visible + hidden runs':34}{suite_rate:10.1f}{1000 / suite_rate:10.1f}")
    print(f"{'bare python -I -S -c':34}{bare_rate:10.1f}{1000 / bare_rate:10.1f}")
    print(
        f"overhead: {bare_rate / sandbox_rate:.2f}x the time of a bare subprocess "
        f"({args.workers} workers, {args.n} runs each)"
    )


if __name__ == "__main__":
    main()
