"""`rlvr report` and `rlvr runs compare`: plots, alerts, rollouts and escaping on hand-made run
directories; one real tiny run rendered in headless Chromium (every image must load)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rlvr.errors import ConfigError
from rlvr.observe.compare import compare_runs, summary_markdown, summary_rows
from rlvr.observe.report import write_report

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HOSTILE = "<script>window.pwned=1</script><img src=x onerror=alert(1)>"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_run(
    run_dir: Path,
    steps: int = 20,
    *,
    extras: bool = True,
    alerts: bool = True,
    reward: Any = None,
    t0: float = 1000.0,
    algorithm: str = "grpo",
) -> Path:
    """A run directory as the loop writes it: an eval row at step 0, a training row per step (eval
    merged in every 5th), an eval row at the end; with `extras` every optional family of metrics."""
    run_dir.mkdir(parents=True)
    reward = reward or (lambda s: 0.1 + 0.04 * s)
    rows: list[dict[str, Any]] = [{"step": 0, "time": t0, "eval/accuracy": 0.1}]
    for s in range(1, steps + 1):
        row: dict[str, Any] = {
            "step": s,
            "time": t0 + 10.0 * s,
            "reward": reward(s),
            "reward_std": 0.2,
            "frac_reward_zero_std": 0.25,
            "rewards/correct/mean": reward(s),
            "rewards/format/mean": 0.5,
            "completions/mean_length": 20.0 + s,
            "completions/max_length": 40.0,
            "completions/clipped_ratio": 0.1,
            "entropy": 2.0 - 0.05 * s,
            "clip_ratio/region_mean": 0.01,
            "grad_norm": None if s == 7 else 1.0 + 0.1 * s,  # a non-finite value is logged as null
            "rollout/in_group_std": 0.2,
            "tools/call_frequency": 0.0,  # logged by every run: all-zero means no tool was used
            "turns/mean": 1.0,
            "turns/max": 1.0,
            "step_time": 10.0,
        }
        if extras:
            row |= {
                "kl": 0.001 * s,
                "tools/call_frequency": 1.5,
                "tools/failure_frequency": 0.2,
                "tools/errors/malformed": 1.0,
                "turns/mean": 2.5,
                "turns/max": 4.0,
                "critic/value_loss": 0.5,
                "critic/explained_variance": 0.3,
                "critic/values_mean": 0.2,
                "critic/returns_mean": 0.25,
                "env/arith/reward": 0.4,
                "env/calc/reward": 0.6,
            }
        if s % 5 == 0:
            row |= {"eval/accuracy": 0.1 + 0.02 * s}
            if extras:
                row |= {"eval/arith/accuracy": 0.2, "eval/calc/accuracy": 0.3}
        if alerts and s == 12:  # as the monitors write it: an event row and a key in the step row
            row["alerts/entropy_collapse"] = 1.0
            rows.append(
                {
                    "step": 12,
                    "time": t0 + 120.0,
                    "event": "entropy_collapse",
                    "action": "warn",
                    "message": "entropy fell below 1.5 <fast>",
                    "evidence": {"entropy": 1.4, "early_mean": 1.95},
                }
            )
        if alerts and s == 15:
            row["alerts/echo_trap/grad_spike"] = 1.0  # a key with no event row
        rows.append(row)
    rows.append({"step": steps, "time": t0 + 10.0 * steps + 5, "eval/accuracy": 0.9})
    write_jsonl(run_dir / "metrics.jsonl", rows)
    rollouts = [
        {
            "step": s,
            "task_id": f"t{s}-{i}",
            "source": "arith",
            "completion": HOSTILE if (s, i) == (1, 5) else f"answer {s}.{i}",
            "messages": [{"role": "assistant", "content": f"answer {s}.{i}"}]
            + ([{"role": "tool", "content": HOSTILE}] if (s, i) == (20, 7) else []),
            "reward": i / 10,
            "rewards": {"correct": i / 10, "format": 1.0},
            "errors": {},
            "finish_reason": "stop",
            "num_tokens": 5,
            "num_turns": 1,
        }
        for s in range(1, steps + 1)
        for i in range(8)
    ]
    write_jsonl(run_dir / "rollouts.jsonl", rollouts)
    (run_dir / "config.yaml").write_text(
        f"algorithm: {algorithm}\nmodel:\n  name: some/model\nrewards:\n"
        "- {fn: numeric_match, name: correct, weight: 1.0}\n"
        "- {fn: regex_format, name: format, weight: 0.0}\n"
        "task:\n  prompt: 'What is {a} <op> {b}?'\n"
    )
    return run_dir


def images(index: Path) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', index.read_text())


ALL_PLOTS = {
    "reward", "eval_accuracy", "source_reward", "entropy", "kl", "completion_length", "truncated",
    "clip_ratio", "grad_norm", "group_signal", "tools", "tool_errors", "turns", "critic_fit",
    "critic_values", "step_time",
}  # fmt: skip


@pytest.fixture(scope="module")
def full_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of a hand-made run that logged every family of metrics and two alerts."""
    run = make_run(tmp_path_factory.mktemp("full") / "run")
    index = write_report(run)
    assert index == run / "report" / "index.html"
    return index


def test_every_plot_is_written_and_referenced_relatively(full_report: Path) -> None:
    index = full_report
    srcs = images(index)
    assert {Path(s).stem for s in srcs} == ALL_PLOTS
    for src in srcs:
        assert not src.startswith(("/", "file:", "http")), src
        assert (index.parent / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = index.read_text()
    assert "eval/arith/accuracy" in page and "eval/calc/accuracy" in page


def test_missing_metrics_skip_their_plots(tmp_path: Path) -> None:
    """No KL, critic, sources; tools and turns logged but idle (single-turn, no calls): no plot."""
    run = make_run(tmp_path / "run", extras=False, alerts=False)
    index = write_report(run, tmp_path / "elsewhere")
    assert index == tmp_path / "elsewhere" / "index.html"
    plotted = {Path(s).stem for s in images(index)}
    assert plotted == ALL_PLOTS - {
        "kl", "source_reward", "tools", "tool_errors", "turns", "critic_fit", "critic_values",
    }  # fmt: skip
    assert not (index.parent / "kl.png").exists()
    assert "No alerts were raised" in index.read_text()


def test_alerts_are_marked_on_every_plot_and_listed(full_report: Path) -> None:
    page = full_report.read_text()
    # two alert steps (12: event row and key, merged; 15: key only) -> two lines on each plot
    markers = re.findall(r'data-alert-markers="(\d+)"', page)
    assert len(markers) == len(ALL_PLOTS) and set(markers) == {"2"}
    table = page.split('id="alerts"')[1].split("</table>")[0]
    rows = re.findall(r'<tr class="alert">' + "<td>([^<]*)</td>" * 5, table)
    assert rows == [
        (
            "12",
            "entropy_collapse",
            "warn",
            "entropy fell below 1.5 &lt;fast&gt;",
            "entropy=1.400 early_mean=1.950",
        ),
        ("15", "echo_trap/grad_spike", "", "", ""),
    ]


def test_hostile_text_is_escaped(full_report: Path) -> None:
    page = full_report.read_text()
    assert HOSTILE not in page and "<img src=x" not in page
    # once as a completion (step 1), once as a tool's answer in a multi-turn episode (step 20)
    assert page.count("&lt;script&gt;window.pwned=1&lt;/script&gt;") == 2
    assert page.count("<script>") == 1  # the page's own image check
    assert "What is {a} &lt;op&gt; {b}?" in page  # config.yaml shown as escaped text


def test_best_and_worst_rollouts_of_first_middle_last_step(full_report: Path) -> None:
    page = full_report.read_text()
    assert re.findall(r'<h3 id="rollouts-(\d+)"', page) == ["1", "11", "20"]
    step_20 = page.split('id="rollouts-20"')[1]
    # rewards are i/10 for i = 0..7: best 0.7, 0.6, 0.5; worst shown worst first 0.0, 0.1, 0.2
    shown = re.findall(r"reward <b>([\d.]+)</b>", step_20)
    assert shown == ["0.700", "0.600", "0.500", "0.000", "0.100", "0.200"]
    assert "answer 20.7" in step_20 and "answer 20.3" not in step_20


def test_nulls_and_a_half_written_last_line_are_tolerated(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", extras=False)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 21, "reward": 0.')  # a live run mid-write
    summary = summary_rows([run])[0]
    assert summary.steps == 20


def test_user_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no metrics\.jsonl"):
        write_report(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no metric rows"):
        write_report(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        write_report(tmp_path / "empty")
    with pytest.raises(ConfigError, match="at least one run"):
        compare_runs([], tmp_path / "cmp")


def test_compare_numbers_and_files(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a" / "run", steps=10, extras=False, reward=lambda s: s / 10)
    b = make_run(tmp_path / "b" / "run", steps=20, algorithm="dr_grpo", t0=5000.0)
    rows = summary_rows([a, b])
    assert [r.run for r in rows] == ["a/run", "b/run"]  # same folder name: parent/name
    ra, rb = rows
    # a: rewards 0.1..1.0; the last 5 steps 6..10 -> (0.6 + 0.7 + 0.8 + 0.9 + 1.0) / 5 = 0.8
    assert ra.final_reward == pytest.approx(0.8)
    # eval/accuracy of a: 0.1 (step 0), 0.2 (5), 0.3 (10), then 0.9 (the end row at step 10)
    assert (ra.best_accuracy, ra.final_accuracy) == (pytest.approx(0.9), pytest.approx(0.9))
    # entropy 2 - 0.05 s over s = 6..10 -> 2 - 0.05 * 8 = 1.6
    assert ra.final_entropy == pytest.approx(1.6)
    assert ra.wall_seconds == pytest.approx(105.0)  # times 1000 .. 1000 + 10 * 10 + 5
    assert (ra.steps, ra.algorithm, ra.model) == (10, "grpo", "some/model")
    # b: rewards 0.1 + 0.04 s over s = 16..20 -> 0.1 + 0.04 * 18 = 0.82
    assert rb.final_reward == pytest.approx(0.82)
    assert (rb.steps, rb.algorithm, rb.wall_seconds) == (20, "dr_grpo", pytest.approx(205.0))

    html_path = compare_runs([a, b], tmp_path / "cmp")
    srcs = images(html_path)
    assert {Path(s).stem for s in srcs} == {
        "reward", "eval_accuracy", "entropy", "kl", "completions_mean_length", "grad_norm",
    }  # fmt: skip
    assert all((html_path.parent / s).is_file() for s in srcs)
    assert "not logged by a/run" in html_path.read_text()  # only b has a KL curve
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| a/run | grpo | some/model | 10 | 0.800 | 0.900 | 0.900 | - | 1.600 | 105 s |" in md
    assert all(f"]({s})" in md for s in srcs)


def test_compare_gives_the_gain_over_a_placebo_run(tmp_path: Path) -> None:
    real = make_run(tmp_path / "real", steps=10)
    placebo = make_run(tmp_path / "placebo", steps=10)
    # The placebo arm ends at 0.75 held-out (its last eval row), the real arm at 0.9.
    rows = [json.loads(line) for line in (placebo / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["eval/accuracy"] = 0.75
    write_jsonl(placebo / "metrics.jsonl", rows)
    config = (placebo / "config.yaml").read_text()
    (placebo / "config.yaml").write_text(config + "objective: {placebo: shuffle_within_group}\n")
    a, b = summary_rows([real, placebo])
    assert b.placebo and not a.placebo and a.over_placebo == pytest.approx(0.15)
    md = summary_markdown(summary_rows([real, placebo]))
    assert "| 0.900 | +0.150 |" in md and "| 0.750 | placebo |" in md
    assert summary_rows([real])[0].over_placebo is None  # no placebo given: no column value


# ---------------------------------------------------------------- a real run, in a real browser


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium; required in CI (CI=true), skipped without it elsewhere."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (CI must `apt-get install -y chromium`)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return found


def browse(chromium: str, page: Path, profile: Path, *args: str) -> str:
    cmd = [
        chromium, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
        "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
        "--virtual-time-budget=5000", *args, page.as_uri(),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlvr.config import load_config
    from rlvr.train.loop import train

    config_dir = tmp_path_factory.mktemp("cfg")
    for name in ("tiny.yaml", "tiny_rewards.py"):
        shutil.copy(EXAMPLES / name, config_dir / name)
    out = config_dir / "tinyrun"
    cfg = load_config(
        config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={out}",
            "tracking.progress=false",
            "train.steps=10",
            "eval.every=5",
        ],
    )
    train(cfg, config_dir=config_dir)
    return out


def test_real_run_report_renders_in_headless_chromium(
    chromium: str, tiny_run: Path, tmp_path: Path
) -> None:
    from matplotlib.image import imread

    index = write_report(tiny_run)
    expected = {"reward", "eval_accuracy", "entropy", "completion_length", "grad_norm"}
    srcs = images(index)
    assert expected <= {Path(s).stem for s in srcs}

    dom = browse(chromium, index, tmp_path / "profile", "--dump-dom")
    loaded = re.search(r'data-images-loaded="(\d+)/(\d+)"', dom)
    assert loaded is not None, "the page's load script did not run"
    assert loaded[1] == loaded[2] == str(len(srcs))
    assert "Best and worst rollouts" in dom

    shot = tmp_path / "shot.png"
    browse(chromium, index, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,1600")
    pixels = imread(shot)
    assert pixels.shape[:2] == (1600, 1280)
    assert pixels[..., :3].std() > 0.05  # plots and text, not a blank page

    other = make_run(tmp_path / "fake")
    compare = compare_runs([tiny_run, other], tmp_path / "cmp")
    dom = browse(chromium, compare, tmp_path / "profile", "--dump-dom")
    loaded = re.search(r'data-images-loaded="(\d+)/(\d+)"', dom)
    assert loaded is not None and loaded[1] == loaded[2] == str(len(images(compare)))
