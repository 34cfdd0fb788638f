"""rlvr.registry: the four extension kinds are found the same way (built-in, file, module, entry
point), with one-line errors; a relative file is kept absolute; envs/base no longer imports the
catalog of families built on it."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

from rlvr.algorithms import ALGORITHMS as BUILTIN_ALGORITHMS
from rlvr.config import load_config
from rlvr.errors import ConfigError
from rlvr.registry import ALGORITHMS, ENVS, REWARDS, TRACKERS, absolute_ref

SRC = Path(__file__).resolve().parent.parent / "src" / "rlvr"


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, group: str, name: str, value: str) -> None:
    """An installed plug-in, as `pip install` of a package declaring it would leave it."""
    real = importlib.metadata.entry_points
    plugin = importlib.metadata.EntryPoint(name=name, value=value, group=group)

    def entry_points(**selection: Any) -> Any:
        if selection.get("group") == group:
            return importlib.metadata.EntryPoints([plugin])
        return real(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_built_ins_resolve_to_their_objects() -> None:
    assert ALGORITHMS.resolve("grpo") is BUILTIN_ALGORITHMS["grpo"]
    assert ENVS.resolve("calculator").name == "calculator"
    assert REWARDS.resolve("numeric_match").__name__ == "numeric_match"
    assert TRACKERS.resolve("wandb").name == "wandb"


def test_an_entry_point_plugin_is_found_by_its_short_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An installed package's algorithm: here the built-in DAPO under another name.
    (tmp_path / "my_rlvr_plugin.py").write_text(
        "from rlvr.algorithms import ALGORITHMS\nMY_DAPO = ALGORITHMS['dapo']\nNOT_ONE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, "rlvr.algorithms", "my_dapo", "my_rlvr_plugin:MY_DAPO")
    assert "my_dapo" in ALGORITHMS.names()
    assert ALGORITHMS.resolve("my_dapo") is BUILTIN_ALGORITHMS["dapo"]
    cfg = load_config(None, ["algorithm=my_dapo"])
    assert cfg.algorithm == "my_dapo" and cfg.objective.epsilon_high == 0.28
    _fake_entry_points(monkeypatch, "rlvr.algorithms", "broken", "my_rlvr_plugin:NOT_ONE")
    with pytest.raises(ConfigError, match=r"algorithm 'broken' is a int, not an rlvr"):
        ALGORITHMS.resolve("broken")
    _fake_entry_points(monkeypatch, "rlvr.algorithms", "gone", "no_such_plugin_xyz:A")
    with pytest.raises(ConfigError, match="loading plug-in 'no_such_plugin_xyz:A'"):
        ALGORITHMS.resolve("gone")


def test_an_unknown_name_lists_the_known_ones_and_the_other_ways() -> None:
    with pytest.raises(ConfigError) as err:
        ENVS.resolve("nosuch")
    message = str(err.value)
    # Other tests register envs of their own (register_env), so only the built-ins are checked.
    assert message.startswith("task.env.name 'nosuch' is not a known env (one of: ")
    assert all(f"{name}," in message for name in ("bandit", "frozenlake", "sokoban"))
    assert "'file.py:Name', 'package.module:Name', or a plug-in in entry-point group rlvr.envs" in (
        message
    )
    assert "\n" not in message


def test_a_relative_file_is_made_absolute_against_the_config_folder(tmp_path: Path) -> None:
    assert absolute_ref("algo.py:A", tmp_path) == f"{(tmp_path / 'algo.py').resolve()}:A"
    assert absolute_ref("/x/algo.py:A", tmp_path) == "/x/algo.py:A"
    assert absolute_ref("pkg.mod:A", tmp_path) == "pkg.mod:A"
    assert absolute_ref("grpo", tmp_path) == "grpo"
    (tmp_path / "algo.py").write_text(
        "from rlvr.algorithms import ALGORITHMS\nA = ALGORITHMS['dapo']\n"
    )
    (tmp_path / "run.yaml").write_text("algorithm: algo.py:A\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.algorithm == f"{(tmp_path / 'algo.py').resolve()}:A"
    assert cfg.objective.epsilon_high == 0.28  # dapo's defaults, through the file


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_env_protocol_does_not_import_its_catalog_and_the_registry_imports_no_layer() -> None:
    assert "rlvr.envs.catalog" not in _imports(SRC / "envs" / "base.py")
    assert {n for n in _imports(SRC / "registry.py") if n.startswith("rlvr")} == {"rlvr.errors"}
