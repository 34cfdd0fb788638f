"""benchmarks/gpu_check.py as the GPU machine gets it: the packages its image lacks unimportable
(benchmarks/gpu_image.py), a tree without .git, the lease's disk and time (`--dry-run`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_image import MISSING_ON_GPU_IMAGE, blocked_env  # noqa: E402


def _python(code: str, env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_missing_packages_cannot_be_found_and_the_rest_can(tmp_path: Path) -> None:
    env = blocked_env(folder=tmp_path / "site")
    code = (
        "import importlib.util, importlib.metadata\n"
        "assert importlib.util.find_spec('fastapi') is None\n"
        "try:\n    import uvicorn\nexcept ModuleNotFoundError as e:\n    print('blocked', e.name)\n"
        "import torch, httpx, safetensors\n"
        "print('metadata', importlib.metadata.version('httpx'))\n"
    )
    out = _python(code, env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "blocked uvicorn" in out.stdout and "metadata " in out.stdout
    assert {"fastapi", "starlette", "uvicorn"} <= set(MISSING_ON_GPU_IMAGE)


def test_what_gpu_check_imports_needs_none_of_them(tmp_path: Path) -> None:
    """The modules the check's parts import, each under the GPU image's packages: a module-level
    `import fastapi` in rollout/server.py (the crash of issue 61) fails this in seconds."""
    env = blocked_env(folder=tmp_path / "site")
    modules = [
        "rlvr.rollout.server",
        "rlvr.rollout.vllm_colocate",
        "rlvr.rollout.weight_files",
        "rlvr.train.loop",
        "rlvr.plan",
        "rlvr.cli",
        "gpu_check_sync",
        "weight_sync",
    ]
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT / 'src')!r}, {str(ROOT / 'benchmarks')!r}]\n"
        + "".join(f"import {m}\n" for m in modules)
    )
    out = _python(code, env)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_full_run_fits_the_lease_by_its_dry_run() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.endswith(": fits"), last
    seconds = float(last.split(" s of a ")[0].split()[-1])
    disk = float(last.split("disk peak ")[1].split(" GB")[0])
    assert seconds <= 480 and disk <= 40, last
    assert "qwen2.5-7b full lean ckpt" in out.stdout  # the memory row is in the plan


@pytest.mark.slow
def test_the_smoke_run_goes_through_as_the_device_would_run_it(tmp_path: Path) -> None:
    """--allow-cpu --small, every part but the cuda tests, from a copy of the tree without .git and
    with the GPU image's missing packages unimportable: every row runs (or is skipped for vLLM),
    the table is printed, and the check leaves nothing in its temporary folder. ~30 s."""
    tree = tmp_path / "tree"
    for part in ("src", "benchmarks", "examples", "tests/data"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = blocked_env(folder=tmp_path / "site")
    env.update(TMPDIR=str(temp), RLVR_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--allow-cpu", "--small", "--skip-tests",
         "--out", str(tmp_path / "out")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert results["machine"]["commit"] == "unknown (no git)"
    parts = results["parts"]
    errors = [p for p in parts if p.get("ok") is False]
    assert not errors, errors
    skipped = {p["name"] for p in parts if p.get("ok") is None}
    assert skipped <= {"colocated vLLM, in memory", "served vLLM, /dev/shm files"}, skipped
    names = {p["name"] for p in parts if p.get("ok")}
    assert {"qwen2.5-7b full lean ckpt", "file bf16 /dev/shm", "grpo multi-turn"} <= names
    lean = next(p for p in parts if p["name"] == "qwen2.5-7b full lean ckpt")
    assert lean["finite_loss"] and lean["decode_ms_per_step"] > 0
    assert "| qwen2.5-1.5b full bf16 | yes |" in out.stdout
    assert not [p for p in temp.iterdir() if p.name.startswith("rlvr-gpu-check")]
