"""Running model-written code safely: `run_tests` (runner.py) with the in-sandbox harness (harness.py)."""

from rlvr.sandbox.runner import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    TestCase,
    capabilities,
    run_tests,
)

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "TestCase",
    "capabilities",
    "run_tests",
]
