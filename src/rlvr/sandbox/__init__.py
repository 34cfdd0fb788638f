"""Running model-written code safely: `run_tests` (suites.py: visible and hidden tests in separate
runs) over one sandbox run (runner.py) with the in-sandbox harness (harness.py)."""

from rlvr.sandbox.runner import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    TestCase,
    capabilities,
    capability_details,
)
from rlvr.sandbox.suites import SuiteResult, run_tests

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "SuiteResult",
    "TestCase",
    "capabilities",
    "capability_details",
    "run_tests",
]
