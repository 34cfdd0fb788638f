"""`rlvr inspect`: step files of trajectories, and the HTML page that colours their tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlvr.errors import ConfigError
from rlvr.models import tiny_tokenizer
from rlvr.observe.inspect import (
    available_steps,
    marked_text,
    render_all,
    render_html,
    trajectory_rows,
    write_step_trajectories,
)
from rlvr.records import Span, Trajectory

TOKENIZER = tiny_tokenizer()


def encode(text: str) -> list[int]:
    return list(TOKENIZER(text, add_special_tokens=False)["input_ids"])


PROMPT = encode(
    TOKENIZER.apply_chat_template(
        [{"role": "user", "content": "2+2? use <calc> & answer"}],
        tokenize=False,
        add_generation_prompt=True,
    )
)


def single_turn(task_id: str, answer: str, reward: float) -> Trajectory:
    completion = [*encode(answer), TOKENIZER.eos_token_id]
    n = len(PROMPT)
    return Trajectory(
        task_id=task_id,
        token_ids=(*PROMPT, *completion),
        policy_mask=(0,) * n + (1,) * len(completion),
        logprobs=(0.0,) * n + (-0.5,) * len(completion),
        prompt_length=n,
        completion_text=answer,
        finish_reason="stop",
        turns=(Span(n, n + len(completion)),),
        rewards={"correct": reward},
        reward=reward,
        source="arith",
    )


def multi_turn(task_id: str) -> Trajectory:
    """Assistant calls a tool, the env answers (masked), the assistant answers."""
    turn1 = [*encode("<calc>2+2</calc>"), TOKENIZER.eos_token_id]
    observation = encode("\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n")
    turn2 = [*encode("4"), TOKENIZER.eos_token_id]
    n = len(PROMPT)
    a, b = n + len(turn1), n + len(turn1) + len(observation)
    ids = (*PROMPT, *turn1, *observation, *turn2)
    mask = (0,) * n + (1,) * len(turn1) + (0,) * len(observation) + (1,) * len(turn2)
    return Trajectory(
        task_id=task_id,
        token_ids=ids,
        policy_mask=mask,
        logprobs=tuple(-0.25 if m else 0.0 for m in mask),
        prompt_length=n,
        completion_text="4",
        finish_reason="stop",
        turns=(Span(n, a), Span(b, len(ids))),
        rewards={"correct": 1.0, "format": 0.5},
        reward=1.5,
        turn_rewards=(0.5, 1.0),
        source="calc",
        info={"tool_calls": 1, "tool_failures": 0, "note": "dropped: not a number"},
    )


def build_rows() -> tuple[list[Trajectory], list[dict[str, Any]]]:
    trajectories = [
        single_turn("task<&>1", "4", 1.0),
        single_turn("task<&>1", "5", 0.0),
        multi_turn("task-2"),
        single_turn("task-2", "x\ny", 0.0),
    ]
    # per completion token: +1 / -1 for the first group, +0.5 / -2.0 for the second (0 on masked ones)
    advantages: list[list[float]] = []
    for traj, adv in zip(trajectories, [1.0, -1.0, 0.5, -2.0], strict=True):
        advantages.append([adv * m for m in traj.policy_mask[traj.prompt_length :]])
    return trajectories, trajectory_rows(trajectories, advantages, TOKENIZER)


def test_rows_line_up_and_are_json(tmp_path: Path) -> None:
    trajectories, rows = build_rows()
    path = write_step_trajectories(tmp_path, 3, rows)
    assert path == tmp_path / "trajectories" / "step_000003.jsonl"
    read = [json.loads(line) for line in path.read_text().splitlines()]
    assert read == rows
    for traj, row in zip(trajectories, rows, strict=True):
        n = len(traj.token_ids)
        for key in ("tokens", "token_ids", "policy_mask", "logprobs", "advantages"):
            assert len(row[key]) == n, key
        assert row["advantages"][: traj.prompt_length] == [0.0] * traj.prompt_length
        assert "".join(row["tokens"]) == TOKENIZER.decode(list(traj.token_ids))
    multi = rows[2]
    assert multi["turns"] == [[s.start, s.end] for s in trajectories[2].turns]
    assert multi["info"] == {"tool_calls": 1, "tool_failures": 0}  # numbers only
    assert available_steps(tmp_path) == [3]


def test_html_colours_tokens_by_mask_and_advantage(tmp_path: Path) -> None:
    trajectories, rows = build_rows()
    write_step_trajectories(tmp_path, 3, rows)
    page = render_html(tmp_path, step=3)
    assert page == tmp_path / "inspect" / "step_000003.html"
    text = page.read_text()
    for task_id in ("task&lt;&amp;&gt;1", "task-2"):
        assert task_id in text
    assert "task<&>1" not in text

    spans = re.findall(r'<span class="tok (pol|msk)( adv-\w+)?"', text)
    masked = sum(len(t.policy_mask) - t.num_policy_tokens for t in trajectories)
    policy = sum(t.num_policy_tokens for t in trajectories)
    assert sum(kind == "msk" for kind, _ in spans) == masked
    assert sum(kind == "pol" for kind, _ in spans) == policy
    assert all(adv == "" for kind, adv in spans if kind == "msk")
    # positive: trajectories 0 and 2; negative: 1 and 3
    positive = trajectories[0].num_policy_tokens + trajectories[2].num_policy_tokens
    negative = trajectories[1].num_policy_tokens + trajectories[3].num_policy_tokens
    assert sum(adv == " adv-pos" for _, adv in spans) == positive
    assert sum(adv == " adv-neg" for _, adv in spans) == negative
    # the largest |advantage| (2.0) gets the strongest colour
    assert "rgba(220,30,30,0.90)" in text and "rgba(0,170,60,0.51)" in text

    # escaping: single-character tokens '<' and '&', and the special tokens
    assert '">&lt;</span>' in text and '">&amp;</span>' in text
    assert "&lt;|im_start|&gt;" in text and "<calc>" not in text
    assert "↵\n" in text  # newlines shown
    assert 'title="id ' in text and "logprob -0.250" in text and "advantage 0.500" in text
    # multi-turn: turn boundaries, the observation, tool calls in the header
    assert text.count('class="bnd">turn 2<') == 1
    assert text.count('class="bnd obs">observation<') == 1
    assert "tool calls 1, failures 0" in text
    assert text.count("<details") == len(trajectories)
    assert "<script" not in text and "http" not in text


def test_latest_step_by_default_and_missing_step_lists_available(tmp_path: Path) -> None:
    _, rows = build_rows()
    write_step_trajectories(tmp_path, 1, rows[:2])
    write_step_trajectories(tmp_path, 12, rows[2:])
    assert available_steps(tmp_path) == [1, 12]
    page = render_html(tmp_path)
    assert page.name == "step_000012.html"
    assert "task-2" in page.read_text() and "task&lt;&amp;&gt;1" not in page.read_text()

    out = render_html(tmp_path, step=1, out=tmp_path / "x" / "one.html")
    assert out == tmp_path / "x" / "one.html" and "task&lt;&amp;&gt;1" in out.read_text()

    with pytest.raises(ConfigError) as err:
        render_html(tmp_path, step=5)
    message = str(err.value)
    assert "step 5" in message and "1, 12" in message and "\n" not in message

    with pytest.raises(ConfigError, match="no trajectories/ folder"):
        render_html(tmp_path / "nope")


def test_many_steps_are_shortened_in_the_message(tmp_path: Path) -> None:
    for step in range(40):
        write_step_trajectories(tmp_path, step, [])
    with pytest.raises(ConfigError) as err:
        render_html(tmp_path, step=99)
    assert "0, 1, 2, 3, 4, ..., 35, 36, 37, 38, 39 (40 steps)" in str(err.value)


def rlvr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlvr.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_writes_the_page_and_reports_bad_run_dirs(tmp_path: Path) -> None:
    _, rows = build_rows()
    write_step_trajectories(tmp_path, 7, rows)
    proc = rlvr("inspect", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "inspect" / "step_000007.html")
    assert Path(proc.stdout.strip()).exists()

    out = tmp_path / "page.html"
    proc = rlvr("inspect", str(tmp_path), "--step", "7", "--out", str(out))
    assert proc.returncode == 0 and proc.stdout.strip() == str(out) and out.exists()

    for args in ([str(tmp_path / "missing")], [str(tmp_path), "--step", "8"]):
        proc = rlvr("inspect", *args)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "available steps: 7" in proc.stderr


def shown_indices(page: Path) -> list[int]:
    return [
        int(i)
        for i in re.findall(r'<div class="hdr"><span class="kv"><b>#(\d+)</b>', page.read_text())
    ]


def test_turn_rewards_in_rows_and_in_the_header(tmp_path: Path) -> None:
    _, rows = build_rows()
    assert rows[2]["turn_rewards"] == [0.5, 1.0] and rows[0]["turn_rewards"] == []
    write_step_trajectories(tmp_path, 1, rows)
    text = render_html(tmp_path).read_text()
    assert text.count("turn rewards ") == 1 and "turn rewards 0.500, 1.000" in text
    # a step file from before rows carried turn rewards still renders
    old = [{k: v for k, v in r.items() if k != "turn_rewards"} for r in rows]
    write_step_trajectories(tmp_path, 2, old)
    assert "turn rewards" not in render_html(tmp_path, step=2).read_text()


def test_sort_and_filter_by_reward(tmp_path: Path) -> None:
    _, rows = build_rows()  # rewards: #0 1.0, #1 0.0, #2 1.5, #3 0.0
    write_step_trajectories(tmp_path, 4, rows)
    assert shown_indices(render_html(tmp_path)) == [0, 1, 2, 3]  # by group, as sampled
    best = render_html(tmp_path, sort="reward", out=tmp_path / "best.html")
    assert shown_indices(best) == [2, 0, 1, 3]
    assert "all trajectories, highest reward first" in best.read_text()
    worst = render_html(tmp_path, sort="-reward", out=tmp_path / "worst.html")
    assert shown_indices(worst) == [1, 3, 0, 2]

    high = render_html(tmp_path, min_reward=1.0, out=tmp_path / "high.html")
    assert shown_indices(high) == [0, 2]
    text = high.read_text()
    assert "showing 2 of 4 trajectories (reward &ge; 1.000)" in text
    assert "2 trajectories, mean reward 0.500" in text  # group means stay over the whole group
    zero = render_html(tmp_path, sort="reward", max_reward=0.5, out=tmp_path / "zero.html")
    assert shown_indices(zero) == [1, 3]
    none = render_html(tmp_path, min_reward=5.0, out=tmp_path / "none.html")
    assert shown_indices(none) == [] and "showing 0 of 4" in none.read_text()
    with pytest.raises(ConfigError, match="sort 'best'"):
        render_html(tmp_path, sort="best")  # type: ignore[arg-type]


def test_pages_link_to_the_previous_and_next_saved_steps(tmp_path: Path) -> None:
    _, rows = build_rows()
    for step in (1, 12, 20):
        write_step_trajectories(tmp_path, step, rows)
    pages = render_all(tmp_path)
    assert [p.name for p in pages] == ["step_000001.html", "step_000012.html", "step_000020.html"]
    links = [re.findall(r'<a href="(step_\d+\.html)">', p.read_text()) for p in pages]
    assert links == [
        ["step_000012.html"],
        ["step_000001.html", "step_000020.html"],
        ["step_000012.html"],
    ]
    for page_links in links:  # every link resolves to a written page
        assert all((tmp_path / "inspect" / name).is_file() for name in page_links)
    assert "&larr; step 1</a> <b>step 12</b>" in pages[1].read_text()


def test_marked_text_brackets_trained_runs() -> None:
    tokens = ["<s>", "ask", "A", "B", "</s>", "obs", "C"]
    mask = [0, 0, 1, 1, 1, 0, 1]
    assert marked_text(tokens, mask) == "<s>ask[[AB</s>]]obs[[C]]"
    coloured = marked_text(tokens, mask, colour=True)
    assert "\x1b[1;32mAB</s>\x1b[0m" in coloured and "\x1b[2;37mobs\x1b[0m" in coloured


def test_cli_sort_filter_and_all(tmp_path: Path) -> None:
    _, rows = build_rows()
    for step in (3, 5):
        write_step_trajectories(tmp_path, step, rows)
    proc = rlvr("inspect", str(tmp_path), "--all", "--sort", "reward", "--min-reward", "0.5")
    assert proc.returncode == 0, proc.stderr
    pages = [Path(line) for line in proc.stdout.split()]
    assert [p.name for p in pages] == ["step_000003.html", "step_000005.html"]
    assert shown_indices(pages[1]) == [2, 0] and 'href="step_000003.html"' in pages[1].read_text()
    proc = rlvr("inspect", str(tmp_path), "--sort", "size")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --sort 'size'")
