"""Sandbox throughput: executions per second of a trivial passing program, and the sandbox's
overhead against a bare `python -c` subprocess, side by side in one run.

    python benchmarks/sandbox.py [--n 40] [--workers 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from rlvr.sandbox import TestCase, capabilities, run_tests

PROGRAM = "def solve(x):\n    return 2 * x\n"
TESTS = [TestCase((1,), 2), TestCase((5,), 10, hidden=True)]


def sandboxed() -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"isolation: {capabilities()}")
    sandbox_rate = rate(sandboxed, args.n, args.workers)
    bare_rate = rate(bare, args.n, args.workers)
    print(f"{'':28}{'exec/s':>10}{'ms/exec':>10}")
    print(f"{'rlvr sandbox':28}{sandbox_rate:10.1f}{1000 / sandbox_rate:10.1f}")
    print(f"{'bare python -I -S -c':28}{bare_rate:10.1f}{1000 / bare_rate:10.1f}")
    print(
        f"overhead: {bare_rate / sandbox_rate:.2f}x the time of a bare subprocess "
        f"({args.workers} workers, {args.n} runs each)"
    )


if __name__ == "__main__":
    main()
