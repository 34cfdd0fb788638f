"""Running model-written code safely: `run_tests` (suites.py: visible and hidden tests in separate
runs) over one sandbox run (runner.py) with the in-sandbox harness (harness.py), here or through a
sandbox service (client.py; `rlvr sandbox serve` is service.py)."""

# client.run_tests is suites.run_tests here, or the same through a configured service.
from rlvr.sandbox.client import SandboxServiceError, configure, run_tests
from rlvr.sandbox.runner import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    TestCase,
    capabilities,
    capability_details,
)
from rlvr.sandbox.suites import SuiteResult

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "SandboxServiceError",
    "SandboxUnavailable",
    "SuiteResult",
    "TestCase",
    "capabilities",
    "capability_details",
    "configure",
    "run_tests",
]
