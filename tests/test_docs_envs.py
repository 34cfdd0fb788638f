"""docs/envs.md runs as written: its Python blocks are one file (`my_envs.py`), played through
`rlvr env check`; its config block loads; its `rlvr env check` command line exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from rlvr.authoring.check import check_env
from rlvr.config import load_config
from rlvr.envs import get_env_family
from rlvr.models import tiny_tokenizer

DOC = Path(__file__).resolve().parent.parent / "docs" / "envs.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.DOTALL)


def write_module(folder: Path) -> Path:
    path = folder / "my_envs.py"
    path.write_text("\n\n".join(blocks("python")))
    return path


def run_check(name: str, **kwargs: object) -> tuple[int, str]:
    lines: list[str] = []
    problems = check_env(name, tokenizer=tiny_tokenizer(), write=lines.append, **kwargs)
    return problems, "\n".join(lines)


def test_the_guess_env_plays_solves_and_names_its_states(tmp_path: Path) -> None:
    path = write_module(tmp_path)
    problems, out = run_check(f"{path}:GuessFamily", episodes=3)
    assert problems == 0, out
    assert out.count("reward parts over the episode: format=1, success=1") == 3, out
    assert "<|im_start|>user\nHigher.<|im_end|>" in out or "<|im_start|>user\nLower." in out
    assert "state_key=(" in out

    family = get_env_family(f"{path}:GuessFamily", {"high": 16})
    env = family.make(family.generate(0))
    bad = env.step("no idea")
    assert bad.info == {"invalid": 1} and bad.rewards == {"success": 0.0, "format": 0.0}
    assert bad.messages[0]["content"] == "Answer with <guess>N</guess>."
    assert env.step("<guess>0</guess>").rewards["format"] == 1.0
    assert env.step("<guess>0</guess>").rewards["format"] == 0.0  # paid once


def test_the_inventory_tool_env_plays_and_its_tool_fails_softly(tmp_path: Path) -> None:
    path = write_module(tmp_path)
    problems, out = run_check(f"{path}:InventoryFamily", episodes=2)
    assert problems == 0, out
    assert '"name": "stock"' in out and "How many units of an item are in stock." in out
    assert out.count("reward parts: success=1, format=1, looked_up=1") == 2

    family = get_env_family(f"{path}:InventoryFamily")
    env = family.make(family.generate(0))
    call = '<tool_call>{"name": "stock", "arguments": {"item": "kiwis"}}</tool_call>'
    step = env.step(call)
    assert step.info["tool_errors/raised"] == 1 and "no item 'kiwis'" in step.messages[0]["content"]
    wrong = env.step('<tool_call>{"name": "stock", "arguments": {"item": 3}}</tool_call>')
    assert wrong.info["tool_errors/bad_arguments"] == 1


def test_the_config_block_loads_and_names_the_doc_env(tmp_path: Path) -> None:
    write_module(tmp_path)
    [config] = blocks("yaml")
    (tmp_path / "my_config.yaml").write_text(config)
    cfg = load_config(tmp_path / "my_config.yaml")
    assert cfg.task.env is not None and cfg.task.env.name == "my_envs.py:InventoryFamily"
    assert yaml.safe_load(config)["rollout"]["max_turns"] == 3


def test_the_documented_command_line_runs(tmp_path: Path) -> None:
    write_module(tmp_path)
    [commands] = blocks("bash")
    line = next(c for c in commands.splitlines() if "GuessFamily" in c)
    args = line.split()[
        1:
    ]  # rlvr env check my_envs.py:GuessFamily --set high=100 --tokenizer tiny-random
    env = {**os.environ, "RLVR_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "rlvr.cli", *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "options {'high': 100}" in proc.stdout and "policy: scripted" in proc.stdout
