"""`rlvr env check`: the rendered template, tool schemas, trained vs masked tokens and reward parts
of a few episodes, for a built-in tool env (calculator) and for user env files."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr.authoring.check import check_env
from rlvr.models import eos_token_ids, load_policy, tiny_tokenizer
from rlvr.observe.inspect import TRAINED_CLOSE, TRAINED_OPEN
from rlvr.rollout.hf import HFGenerator
from test_tool_formats import family_tokenizer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TRAINED = re.compile(re.escape(TRAINED_OPEN) + r"(.*?)" + re.escape(TRAINED_CLOSE), re.DOTALL)


def run_check(name: str, **kwargs: object) -> tuple[int, str]:
    lines: list[str] = []
    problems = check_env(name, write=lines.append, **kwargs)
    return problems, "\n".join(lines)


def masked_only(text: str) -> str:
    return TRAINED.sub("", text)


def test_calculator_random_policy_shows_schema_masks_and_reward_parts() -> None:
    problems, out = run_check("calculator", tokenizer=tiny_tokenizer(), episodes=1)
    assert problems == 0 and out.endswith("ok: template and masks look right"), out
    assert "policy: random" in out
    # the schema, as the model sees it: ChatML ignores tools=, so rlvr writes it into the system message
    assert "injected into the system message" in out
    assert '"name": "calculator"' in out and '"expression"' in out
    prompt = out.split("--- rendered prompt")[1].split("--- turn 1")[0]
    assert "<tools>" in prompt and '"name": "calculator"' in prompt
    assert "<|im_start|>system\nSolve the problem exactly." in prompt
    assert "<tool_call>" in out and "tool-call format" in out
    # turn 1: a random call (trained), the tool's error result (masked)
    turn1 = out.split("--- turn 1:")[1].split("--- turn 2:")[0]
    trained = TRAINED.findall(turn1)
    assert len(trained) == 1 and trained[0].startswith('<tool_call>\n{"name": "calculator"')
    assert "<|im_start|>tool\nError: " in masked_only(turn1)
    assert "<|im_start|>tool" not in trained[0]
    assert "info: tool_calls=1, tool_failures=1" in turn1
    # turn 2: the random answer is scored with the calculator's parts
    turn2 = out.split("--- turn 2:")[1]
    assert re.search(r"reward parts: success=0, format=1, used_tool=0", turn2)
    assert "reward parts over the episode: format=1, used_tool=0, success=0" in out
    assert "reward 0.1 (per turn: 0, 0.1)" in out


def test_calculator_sampled_from_the_tiny_model(tiny_model_dir: Path) -> None:
    """--model: the turns come from the model (fp32, autocast off: no precision mark needed)."""
    policy = load_policy(str(tiny_model_dir))
    tok = policy.tokenizer
    gen = HFGenerator(policy.model, tok, eos_token_ids(policy.model, tok), autocast_bf16=False)
    problems, out = run_check(
        "calculator", tokenizer=tok, generator=gen, episodes=2, max_new_tokens=8
    )
    assert problems == 0, out
    assert "policy: model" in out and out.count("=== episode") == 2
    for n_trained in re.findall(r"--- turn \d+: (\d+) tokens trained", out):
        assert 1 <= int(n_trained) <= 8
    assert out.count("reward parts:") >= 2


def rlvr(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlvr.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_cli_on_a_user_tool_env_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "unit_converter_env.py", tmp_path / "my_env.py")
    proc = rlvr(
        "env", "check", "my_env.py:UnitConverterFamily", "--tokenizer", str(tiny_model_dir),
        "--episodes", "2", "--set", "max_value=5", cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr + out
    assert "policy: scripted" in out and "options {'max_value': 5}" in out
    assert '"name": "convert"' in out and "The unit of the amount: mm, cm, m or km." in out
    assert out.count("=== episode") == 2
    # the scripted call is trained; the tool's result comes back masked; the answer is trained
    for turn1, turn2 in re.findall(r"--- turn 1:(.*?)--- turn 2:(.*?)--- episode end", out, re.S):
        calls = TRAINED.findall(turn1)
        assert len(calls) == 1 and '"name": "convert"' in calls[0]
        result = re.search(r"<\|im_start\|>tool\n([^<]+)<\|im_end\|>", masked_only(turn1))
        assert result is not None
        assert TRAINED.findall(turn2) == [f"<answer>{result[1]}</answer><|im_end|>"]
        assert "reward parts: call_shape=1" in turn1
        assert "reward parts: success=1, format=1, used_tool=1" in turn2
    assert out.count("reward 1.1 (per turn: 0, 1.1)") == 2
    assert out.rstrip().endswith("ok: template and masks look right")

    bad = rlvr("env", "check", "my_env.py:UnitConverterFamily", "--tokenizer", str(tiny_model_dir),
               "--set", "max_value=1", cwd=tmp_path)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("error: task.env.options.max_value")


BROKEN_ENV = """
from rlvr.envs import Env, EnvFamily, EnvReset, EnvStep
from rlvr.records import Task


class CountdownEnv(Env):
    max_turns = 3

    def __init__(self, task):
        self.task, self.turns = task, 0

    def reset(self):
        return EnvReset([{"role": "user", "content": "Say a word."}])

    def step(self, text):
        self.turns += 1
        if self.turns == 2:
            raise KeyError("lost the state")
        return EnvStep(messages=[{"role": "user", "content": "Another word, please."}],
                       rewards={"spoke": 1.0}, info={"state_key": self.turns})


class BrokenFamily(EnvFamily):
    name = "broken"
    description = "raises on its second turn"
    success_metric = "spoke"

    def generate(self, seed):
        return Task(id=f"broken:{seed}", messages=())

    def make(self, task):
        return CountdownEnv(task)
"""


def test_a_plain_user_env_with_random_text_and_an_env_error(tmp_path: Path) -> None:
    path = tmp_path / "broken_env.py"
    path.write_text(BROKEN_ENV)
    problems, out = run_check(f"{path}:BrokenFamily", tokenizer=tiny_tokenizer(), episodes=1)
    assert "policy: random" in out and "tools: none" in out
    turn1 = out.split("--- turn 1:")[1].split("--- turn 2:")[0]
    assert "<|im_start|>user\nAnother word, please.<|im_end|>" in masked_only(turn1)
    assert "reward parts: spoke=1" in turn1 and "info: state_key=1" in turn1
    assert "finish error, 2 turns" in out
    assert problems == 1 and "PROBLEM: the env failed: KeyError: 'lost the state'" in out


DEMO_EXPRESSION = '{"expression": "12 * 14"}'  # the calculator's worked example, in Hermes


@pytest.mark.parametrize(
    ("folder", "name", "call_start", "demo"),
    [
        (
            "llama3",
            "llama3_json",
            '{"name": "calculator", "parameters": {',
            f'{{"name": "calculator", "parameters": {DEMO_EXPRESSION}}}<|eot_id|>',
        ),
        (
            "mistral",
            "mistral",
            '[TOOL_CALLS][{"name": "calculator", "arguments": {',
            f'[TOOL_CALLS][{{"name": "calculator", "arguments": {DEMO_EXPRESSION}, "id": "demo00001"}}]',
        ),
        (
            "qwen3",
            "qwen3",
            '<tool_call>\n{"name": "calculator", "arguments": {',
            f'<tool_call>\n{{"name": "calculator", "arguments": {DEMO_EXPRESSION}}}\n</tool_call>',
        ),
    ],
)
def test_the_chosen_tool_call_format_is_shown_and_spoken(
    folder: str, name: str, call_start: str, demo: str
) -> None:
    """With each family's real template (tests/data/tokenizers/): the format detected is printed, the
    random policy writes its call in it, the env reads it, and the calculator's Hermes-written
    demonstration reaches the prompt in the family's own format."""
    problems, out = run_check("calculator", tokenizer=family_tokenizer(folder), episodes=1)
    assert problems == 0, out
    assert f"tool-call format: {name} (auto: detected from the chat template" in out
    turn1 = out.split("--- turn 1:")[1].split("--- turn 2:")[0]
    assert TRAINED.findall(turn1)[0].startswith(call_start)
    assert "info: tool_calls=1" in turn1
    assert demo in out.split("--- rendered prompt")[1].split("--- turn 1")[0]
    forced = run_check("calculator", tokenizer=tiny_tokenizer(), episodes=1, tool_format=name)[1]
    assert f"tool-call format: {name} (set by --tool-format / rollout.tool_format" in forced


def test_cli_scripted_hermes_calls_are_rewritten_for_a_tokenizer_folder(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "unit_converter_env.py", tmp_path / "my_env.py")
    mistral = Path(__file__).resolve().parent / "data" / "tokenizers" / "mistral"
    proc = rlvr("env", "check", "my_env.py:UnitConverterFamily", "--tokenizer", str(mistral),
                "--episodes", "1", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "tool-call format: mistral (auto" in proc.stdout
    turn1 = proc.stdout.split("--- turn 1:")[1].split("--- turn 2:")[0]
    assert TRAINED.findall(turn1)[0].startswith('[TOOL_CALLS][{"name": "convert"')
    assert '[TOOL_RESULTS]{"content": ' in masked_only(turn1) and '"call_id": "call00001"}' in turn1
    bad = rlvr(
        "env", "check", "my_env.py:UnitConverterFamily", "--tool-format", "gemma", cwd=tmp_path
    )
    assert bad.returncode == 2 and "--tool-format 'gemma'" in bad.stderr
