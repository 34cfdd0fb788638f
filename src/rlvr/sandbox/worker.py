"""One worker process of `rlvr sandbox serve` (service.py): it runs one request at a time in the
sandbox of this module's own process (its own zygote), so N workers are N runs at once, and a
worker that dies takes only its own request with it: the service answers that request as an
error and starts another worker.

    python -m rlvr.sandbox.worker        (started by service.py; one JSON object a line each way)

Requests: {"op": "run_tests", "code", "entry", "tests": [{"args", "expected", "hidden"}],
"wall_seconds", "skip_hidden_after_visible_failure"} -> the SuiteResult's fields;
{"op": "run_program", "code", "wall_seconds"} -> the ProgramResult's fields. A failure to run is
{"error": text, "kind": "unavailable" | "bad_request" | "internal"}, never a verdict. The first
line out is {"ready": ..., "mode": ...} once the sandbox has been probed (the zygote is warm).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from rlvr.sandbox.runner import (
    SandboxLimits,
    SandboxUnavailable,
    TestCase,
    capabilities,
    mode,
    run_program,
)
from rlvr.sandbox.suites import run_tests


def handle(request: dict[str, Any]) -> dict[str, Any]:
    limits = SandboxLimits(wall_seconds=float(request.get("wall_seconds", 10.0)))
    if request.get("op") == "run_tests":
        tests = [
            TestCase(tuple(t["args"]), t["expected"], hidden=bool(t.get("hidden", False)))
            for t in request["tests"]
        ]
        skip = bool(request.get("skip_hidden_after_visible_failure", False))
        result = run_tests(
            request["code"],
            request["entry"],
            tests,
            limits,
            skip_hidden_after_visible_failure=skip,
        )
        return dataclasses.asdict(result)
    if request.get("op") == "run_program":
        return dataclasses.asdict(run_program(request["code"], limits))
    return {"error": f"unknown op {request.get('op')!r}", "kind": "bad_request"}


def main() -> None:
    # The protocol has this descriptor to itself: whatever else prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    caps = capabilities()  # starts the zygote and probes the host before the first request
    answers.write(json.dumps({"ready": True, "mode": mode(), "capabilities": caps}) + "\n")
    answers.flush()
    for line in sys.stdin:
        try:
            answer = handle(json.loads(line))
        except SandboxUnavailable as exc:
            answer = {"error": str(exc), "kind": "unavailable"}
        except (KeyError, TypeError, ValueError) as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}", "kind": "bad_request"}
        except Exception as exc:  # answered as an error; the worker lives on
            answer = {"error": f"{type(exc).__name__}: {exc}", "kind": "internal"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
