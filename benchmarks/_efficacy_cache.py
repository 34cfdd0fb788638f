"""benchmarks/efficacy.py's cache of the base model's per-instance held-out results.

Re-measuring a row (other `--set` hyper-parameters) trains again, but its base model is unchanged:
scoring it again costs minutes per row and gives the same per-instance results. So the base side of
a row is stored as JSON under the cache dir, named by a key (sha256) over everything that decides
it: the model's files (content hashes, not its name), the held-out instances as the eval builds them
(their ids, messages, fields and tools, in order), n and k, the generation settings (max new tokens,
stop strings, bf16, the decode path, the rollout limits: turns, tokens, tool format; temperature and
seed when k > 1), the task, env and reward settings, the eval code (EVAL_VERSION, the scoring
function's source and the rlvr modules it runs), the libraries' versions, the CPU and torch's
thread count. A part that cannot be known (a hub model not on disk, rewards or an env from a module,
an LLM judge, a mixture) leaves the row uncached. Only a base model is ever looked up here; a warm-up
row's SFT model and every trained model are scored fresh.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Bump when what per_instance_scores reports, or how, changes in a way the hashed sources below
# would not show (a changed convention, a bug found in old results): every old entry then misses.
EVAL_VERSION = 1

# The modules the base eval imports (their rlvr imports are followed), and packages hashed whole
# (data files such as code_tasks.json, the sandbox's harness run as a script).
EVAL_MODULES = ("rlvr.build", "rlvr.models", "rlvr.records", "rlvr.rollout.engine",
                "rlvr.rollout.generator", "rlvr.train.sources")  # fmt: skip
EVAL_PACKAGES = ("envs", "rollout", "sandbox", "tasks", "verifiers")
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")


@dataclasses.dataclass(frozen=True)
class Cache:
    """Where base results are stored, and whether to score them again (`--no-base-cache`: the
    stored entry is not read, and the fresh result replaces it)."""

    dir: Path
    refresh: bool = False


@dataclasses.dataclass
class BaseKey:
    key: str | None  # None: some part is unknown, the row is not cached
    why: str  # why not, when key is None
    parts: dict[str, Any]  # what the key hashes (stored beside the results, for a reader)
    ids: list[str]  # the held-out task ids, in the eval's order


def _sha256_file(path: Path) -> str:
    stat = path.stat()  # rows of one invocation read SmolLM2's 0.5 GB once, not once per row
    return _sha256_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_files(name: str) -> dict[str, str] | None:
    """Content hash of every file `from_pretrained` can read for model `name` (alias or directory);
    None for a hub id (not a directory here) or a model that does not resolve."""
    from rlvr.errors import ConfigError
    from rlvr.models import resolve_model_path

    try:
        path = Path(resolve_model_path(name))
    except ConfigError:
        return None
    if not path.is_dir():
        return None
    return {p.name: _sha256_file(p) for p in sorted(path.iterdir()) if p.is_file()}


def _import_closure(package: Path, roots: tuple[str, ...]) -> set[Path]:
    """The .py files of `roots` and of every rlvr module they import, followed statically."""
    found: set[Path] = set()
    todo = list(roots)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or not name.startswith("rlvr"):
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run too
        base = package.parent.joinpath(*parts)
        file = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not file.is_file():
            continue  # a name imported from a module, not a module
        found.add(file)
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return found


@functools.cache
def eval_code(scoring_source: str) -> str:
    """One hash over the scoring function's source and the rlvr code the base eval runs."""
    import rlvr

    package = Path(rlvr.__file__).parent
    files = _import_closure(package, EVAL_MODULES)
    for sub in EVAL_PACKAGES:
        files |= {p for p in (package / sub).rglob("*") if p.is_file() and p.suffix != ".pyc"}
    digest = hashlib.sha256(f"{EVAL_VERSION}\n{scoring_source}".encode())
    for path in sorted(files):
        digest.update(f"\n{path.relative_to(package)}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _code_ref(spec: str, base: Path) -> str | None:
    """A reward's `fn` or an env's `name`: built-in names are in the hashed code; 'file.py:name'
    is hashed by its file; a module reference is unknown (what it imports is not followed)."""
    file_part, sep, _ = spec.rpartition(":")
    if not sep:
        return "built-in"
    if not file_part.endswith(".py"):
        return None
    path = Path(file_part) if Path(file_part).is_absolute() else base / file_part
    return _sha256_file(path) if path.is_file() else None


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for lib in LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = "absent"
    return out


def base_key(
    cfg: Any, model: str, n: int, k: int, config_dir: Path, scoring_source: str, host: str
) -> BaseKey:
    """The cache key of `model` scored as efficacy.per_instance_scores scores it on `cfg`."""
    import torch

    from rlvr.build import rollout_limits, use_bf16
    from rlvr.train.sources import Sources

    def unknown(why: str, ids: list[str] | None = None) -> BaseKey:
        return BaseKey(None, why, {}, ids or [])

    if cfg.mixture or cfg.rollout.mode != "internal":
        return unknown("a mixture or an external agent")
    sources = Sources(cfg, config_dir)
    (source,) = list(sources)
    tasks = source.splits.heldout[:n]
    ids = [t.id for t in tasks]
    if sources.unverifiable:
        return unknown("an LLM judge scores it", ids)
    weights = model_files(model)
    if weights is None:
        return unknown(f"model {model} is not a directory here", ids)
    code_refs = {r.fn: _code_ref(r.fn, config_dir) for r in cfg.rewards}
    if cfg.task.env is not None:
        code_refs[cfg.task.env.name] = _code_ref(cfg.task.env.name, config_dir)
    if None in code_refs.values():
        return unknown("rewards or env from code not hashed here", ids)
    g = cfg.generator
    generation: dict[str, Any] = {
        "greedy": True,
        "max_new_tokens": cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
        "stop": list(cfg.sampling.stop),
        "bf16": [cfg.model.bf16, use_bf16(cfg.model)],
        "decode": [g.decode, g.decode_dtype, g.turn_cache, g.turn_cache_mb],
        "limits": dataclasses.asdict(rollout_limits(cfg)),
    }
    if k > 1:  # the sampled episodes of mean@k
        generation["sampled"] = {"temperature": cfg.sampling.temperature, "seed": cfg.train.seed}
    tasks_json = [
        {"id": t.id, "messages": t.messages, "fields": t.fields, "tools": t.tools, "src": t.source}
        for t in tasks
    ]
    try:
        tasks_hash = hashlib.sha256(json.dumps(tasks_json, sort_keys=True).encode()).hexdigest()
        parts = {
            "eval_code": eval_code(scoring_source),
            "model": {"name": model, "files": weights},
            "instances": {"count": len(tasks), "sha256": tasks_hash, "first": ids[:3]},
            "n": n,
            "k": k,
            "generation": generation,
            "task": cfg.task.model_dump(mode="json"),
            "rewards": [r.model_dump(mode="json") for r in cfg.rewards],
            "code_refs": code_refs,
            "metric": source.metric,
            "env_weights": dict(source.scoring.env_weights),
            "host": {"cpu": host, "torch_threads": torch.get_num_threads(), **_versions()},
        }
        key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    except (TypeError, ValueError) as err:  # a field JSON cannot write: unknown
        return unknown(f"instances or settings not hashable ({err})", ids)
    return BaseKey(key, "", parts, ids)


def _valid(scores: Any, ids: list[str], k: int) -> str:
    """'' when `scores` is what per_instance_scores returns for these instances, else why not."""
    if not isinstance(scores, dict):
        return "no scores object"
    pass1 = scores.get("pass1")
    if not isinstance(pass1, list) or len(pass1) != len(ids) or scores.get("n") != len(ids):
        return "pass1 is not one result per instance"
    if not all(isinstance(v, (int, float)) for v in pass1):
        return "pass1 holds a non-number"
    for name in ("tool_call_rate", "turns", "errors", *([f"mean@{k}"] if k > 1 else [])):
        if not isinstance(scores.get(name), (int, float)):
            return f"{name} missing"
    return ""


def load(path: Path, key: BaseKey, k: int) -> dict[str, Any] | None:
    """The stored base scores at `path`, or None (absent; unreadable: with a one-line warning)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        why = (
            "another key"
            if not isinstance(data, dict) or data.get("key") != key.key
            else "other instances"
            if data.get("ids") != key.ids
            else _valid(data.get("scores"), key.ids, k)
        )
    except (OSError, ValueError) as err:
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if why:
        print(
            f"warning: base cache {path} ignored ({why}); scoring the base model", file=sys.stderr
        )
        return None
    return data["scores"]


def store(path: Path, key: BaseKey, row: str, scores: dict[str, Any]) -> None:
    """Write the entry atomically (a killed run leaves no half file under the entry's name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"key": key.key, "row": row, "ids": key.ids, "scores": scores, "parts": key.parts}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    os.replace(tmp, path)


def cached_base(
    row: str, key: BaseKey, k: int, cache: Cache | None, score: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any], str]:
    """The base scores and how they were had: `cached (<key prefix>)` when read from the cache,
    else `scored (...)` by calling `score`, and then stored when the key is known (no cache: never)."""
    if key.key is None or cache is None:
        return score(), f"scored (not cached: {key.why or 'no cache'})"
    prefix, path = key.key[:12], cache.dir / f"{key.key}.json"
    if not cache.refresh:
        cached = load(path, key, k)
        if cached is not None:
            return cached, f"cached ({prefix})"
    scores = score()
    store(path, key, row, scores)
    return scores, f"scored ({'--no-base-cache; ' if cache.refresh else ''}stored as {prefix})"
