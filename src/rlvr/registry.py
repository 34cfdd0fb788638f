"""How a config names code: one resolver for algorithms, envs, reward functions and trackers.

A name in a config is one of

    grpo                         a built-in (each registry lists its own)
    my_plugin                    an installed plug-in: an entry point in the registry's group
    path/to/file.py:Name         an object in a Python file (relative to the config file's folder)
    package.module:Name          an object in an importable module (`Name` may be dotted)

so a new algorithm, env, reward or tracker is one file (or one installed package) and never an edit
to a list inside rlvr. Entry-point groups: `rlvr.algorithms`, `rlvr.envs`, `rlvr.rewards`,
`rlvr.trackers`; a package declares e.g.

    [project.entry-points."rlvr.algorithms"]
    my_algo = "my_package.algo:MY_ALGO"

This module sits at the bottom of the layers (it imports only rlvr.errors): each registry names its
built-in table as a "module:attribute" string, loaded on first use, so that `rlvr.config` can ask
which names exist without importing torch or the envs at import time.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from rlvr.errors import ConfigError

__all__ = [
    "ALGORITHMS",
    "ENVS",
    "REWARDS",
    "TRACKERS",
    "Registry",
    "absolute_ref",
    "load_object",
]

T = TypeVar("T")

# Longest error text quoted from a failed import: messages stay one line.
_MAX_ERROR_CHARS = 500


def _describe(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split()) if str(exc) else type(exc).__name__
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


# Files loaded by path, keyed by resolved path: two config entries naming objects in one file share
# one module (its top-level code runs once, and an object loaded twice is the same object).
_FILE_MODULES: dict[Path, ModuleType] = {}


def is_file_ref(ref: str) -> bool:
    """True for 'path/to/file.py:Name' (rather than 'package.module:Name' or a plain name)."""
    location, sep, _ = ref.rpartition(":")
    return bool(sep) and (location.endswith(".py") or "/" in location or os.sep in location)


def absolute_ref(ref: str, base_dir: str | os.PathLike[str] | None) -> str:
    """`ref` with a relative file part made absolute against `base_dir` (a config's folder), so a
    saved config names the same file from any working directory; other refs are returned as is."""
    if base_dir is None or not is_file_ref(ref):
        return ref
    location, _, attr = ref.rpartition(":")
    path = Path(location).expanduser()
    if path.is_absolute():
        return ref
    return f"{(Path(base_dir) / path).resolve()}:{attr}"


def _load_file(ref: str, location: str, base_dir: Path | None, what: str) -> ModuleType:
    path = Path(location).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise ConfigError(f"{what} {ref!r}: file {str(path)!r} not found")
    path = path.resolve()
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    # A unique module name, registered in sys.modules, so dataclasses and pickling inside work.
    module_name = f"_rlvr_file_{path.stem}_{abs(hash(str(path))):x}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{what} {ref!r}: cannot load {str(path)!r} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(
            f"{what} {ref!r}: importing {str(path)!r} failed: {_describe(exc)}"
        ) from exc
    _FILE_MODULES[path] = module
    return module


def _import_module(ref: str, module_name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise ConfigError(f"{what} {ref!r}: module {module_name!r} not found") from None
        raise ConfigError(
            f"{what} {ref!r}: importing {module_name!r} failed: {_describe(exc)}"
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"{what} {ref!r}: importing {module_name!r} failed: {_describe(exc)}"
        ) from exc


def load_object(
    ref: str, base_dir: str | os.PathLike[str] | None = None, what: str = "object"
) -> Any:
    """The object `"package.module:attr"` or `"path/to/file.py:attr"` names (`attr` may be dotted).

    A relative file is taken from `base_dir` (else the working directory). `what` says what the
    object is for in every error message. Every failure is a one-line `ConfigError`.
    """
    # rpartition: a Windows path ("C:\\x\\r.py:fn") has a colon of its own.
    location, _, attr_path = ref.rpartition(":")
    if not location or not attr_path:
        raise ConfigError(f"{what} {ref!r}: expected 'module:name' or 'file.py:name'")
    if is_file_ref(ref):
        module = _load_file(ref, location, Path(base_dir) if base_dir is not None else None, what)
    else:
        module = _import_module(ref, location, what)
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{what} {ref!r}: {location!r} has no attribute {part!r}")
        target = getattr(target, part)
    return target


class Registry(Generic[T]):
    """Names of one kind of extension (algorithms, envs, ...) and the objects they stand for.

    `builtins` is a "module:attribute" string naming the dict of built-ins, imported on first use.
    `check` names (the same way) a function `check(obj, ref)` that receives whatever a name resolved
    to and returns it, or raises a ConfigError saying what the object should have been. `field` is the config field that holds such names; it
    starts every error message.
    """

    def __init__(
        self,
        kind: str,
        field: str,
        group: str,
        *,
        builtins: str,
        check: str,
    ) -> None:
        self.kind, self.field, self.group = kind, field, group
        self._builtins_ref, self._check_ref = builtins, check

    def _check(self, obj: Any, ref: str) -> T:
        check: Callable[[Any, str], T] = load_object(self._check_ref, what=f"{self.kind} check")
        return check(obj, ref)

    def builtins(self) -> Mapping[str, T]:
        """The built-in objects by name (the dict itself: registering into it adds a built-in)."""
        table: Mapping[str, T] = load_object(self._builtins_ref, what=f"built-in {self.kind}s")
        return table

    def plugins(self) -> dict[str, importlib.metadata.EntryPoint]:
        """Installed plug-ins of this kind, by entry-point name (loaded only when named)."""
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}

    def names(self) -> list[str]:
        """Every plain name a config may use: the built-ins, then the installed plug-ins."""
        builtins = list(self.builtins())
        return builtins + sorted(set(self.plugins()) - set(builtins))

    def resolve(self, ref: str, base_dir: str | os.PathLike[str] | None = None) -> T:
        """The object `ref` names (module docstring), checked; a ConfigError if there is none."""
        builtins = self.builtins()
        if ref in builtins:
            return self._check(builtins[ref], ref)
        if ":" in ref:
            return self._check(load_object(ref, base_dir, self.kind), ref)
        plugin = self.plugins().get(ref)
        if plugin is None:
            raise ConfigError(self.unknown_message(ref))
        try:
            loaded = plugin.load()
        except Exception as exc:
            raise ConfigError(
                f"{self.kind} {ref!r}: loading plug-in {plugin.value!r} (entry point group "
                f"{self.group}) failed: {_describe(exc)}"
            ) from exc
        return self._check(loaded, ref)

    def unknown_message(self, ref: str) -> str:
        """One line: the field, the unknown name, every known one and the other ways to name one."""
        return (
            f"{self.field} {ref!r} is not a known {self.kind} (one of: {', '.join(self.names())}; "
            f"or 'file.py:Name', 'package.module:Name', or a plug-in in entry-point group "
            f"{self.group})"
        )


# The four registries. Each names its built-in table and its check by "module:attribute", loaded
# when a name is first resolved: this module imports none of them (module docstring).
ALGORITHMS: Registry[Any] = Registry(
    "algorithm",
    "algorithm",
    "rlvr.algorithms",
    builtins="rlvr.algorithms.builtin:BUILTIN_ALGORITHMS",
    check="rlvr.algorithms.builtin:as_algorithm",
)
ENVS: Registry[Any] = Registry(
    "env",
    "task.env.name",
    "rlvr.envs",
    builtins="rlvr.envs.catalog:ENV_FAMILIES",
    check="rlvr.envs.base:as_env_family",
)
REWARDS: Registry[Any] = Registry(
    "reward function",
    "rewards.fn",
    "rlvr.rewards",
    builtins="rlvr.verifiers:BUILTIN_REWARDS",
    check="rlvr.verifiers.rubric:as_reward_function",
)
TRACKERS: Registry[Any] = Registry(
    "tracker",
    "tracking.report_to",
    "rlvr.trackers",
    builtins="rlvr.observe.trackers:BUILTIN_TRACKERS",
    check="rlvr.observe.trackers:as_tracker_class",
)
