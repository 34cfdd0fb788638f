"""benchmarks/efficacy.py, the instrument behind docs/efficacy.md: its statistics by hand, its
target rule, the cache of the base model's results (with fakes standing in for scoring and
training), and one row end to end on the tiny model (the real rows train SmolLM2 for minutes)."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_efficacy(efficacy: ModuleType, argv: list[str]) -> None:
    """benchmarks/efficacy.py's main() with `argv` as its command line."""
    old = sys.argv
    sys.argv = argv
    try:
        efficacy.main()
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def efficacy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("efficacy", ROOT / "benchmarks" / "efficacy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["efficacy"] = module
    spec.loader.exec_module(module)
    return module


def test_paired_bootstrap_interval_by_hand(efficacy: ModuleType) -> None:
    ci = efficacy.paired_bootstrap_ci
    # No instance changed: every resample's mean difference is 0.
    assert ci([0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]) == (0.0, 0.0)
    # Every instance went 0 -> 1: every resample's mean difference is 1.
    assert ci([0.0] * 5, [1.0] * 5) == (1.0, 1.0)
    # Half the instances gained 1, half stayed: the mean of 100 resampled 0/1 values is
    # Binomial(100, 1/2)/100, whose 95% range is about 0.5 +/- 1.96 * 0.05 = (0.40, 0.60).
    low, high = ci([0.0] * 100, [1.0] * 50 + [0.0] * 50)
    assert 0.37 <= low <= 0.42 and 0.58 <= high <= 0.63
    # Pairing matters: after = before shifted by one instance has the same accuracy, gain 0,
    # and an interval around 0 that an unpaired reading would not distinguish.
    low, high = ci([1.0, 0.0] * 50, [0.0, 1.0] * 50)
    assert low < 0.0 < high


def test_targets_are_read_from_the_measured_numbers(efficacy: ModuleType) -> None:
    rows = efficacy.BY_NAME
    # A level with a time condition (the demo: >= 80% in <= 10 min).
    assert efficacy.met(rows["arithmetic"], 0.09, 0.81, 9.5, 0.0)
    assert not efficacy.met(rows["arithmetic"], 0.09, 0.81, 10.5, 0.0)
    assert not efficacy.met(rows["arithmetic"], 0.09, 0.79, 9.5, 0.0)
    # A level with a tool-use condition.
    assert efficacy.met(rows["calculator-1op"], 0.0, 0.91, 25.0, 0.96)
    assert not efficacy.met(rows["calculator-1op"], 0.0, 0.91, 25.0, 0.90)
    # A gain in points.
    assert efficacy.met(rows["frozenlake"], 0.20, 0.50, 25.0, 0.0)
    assert not efficacy.met(rows["frozenlake"], 0.20, 0.49, 25.0, 0.0)
    # Against chance where the env has a random legal policy: the gain counted is over chance
    # (target +30: 0.0 -> 0.45 is +45 over the untrained model and +36 over a chance of 9%: met),
    assert efficacy.met(rows["frozenlake"], 0.0, 0.45, 25.0, 0.0, (0.36, 0.28, 0.44))
    # but +35 over the untrained model that is +5 over chance is not met.
    assert not efficacy.met(rows["frozenlake"], 0.0, 0.35, 25.0, 0.0, (0.05, -0.02, 0.12))
    # and a level reached needs an interval over chance that excludes 0 (bandit: 96% vs 93%).
    assert efficacy.met(rows["bandit"], 0.0, 0.96, 10.0, 0.0, (0.03, 0.01, 0.05))
    assert not efficacy.met(rows["bandit"], 0.0, 0.96, 10.0, 0.0, (0.03, -0.01, 0.07))


def test_gain_over_chance_interval_by_hand(efficacy: ModuleType) -> None:
    chance = efficacy.chance_lib
    # Chance solves nothing and after everything: every resample's difference is 1, paired or not.
    assert chance.bootstrap_gain([1.0] * 10, [0.0] * 10, paired=True) == (1.0, 1.0)
    assert chance.bootstrap_gain([1.0] * 10, [0.0] * 10, paired=False) == (1.0, 1.0)
    # after 50/100 against a chance of exactly 0.5 on every instance: the unpaired difference is
    # Binomial(100, 1/2)/100 - 0.5, 95% range about +/- 1.96 * 0.05 = +/- 0.098.
    low, high = chance.bootstrap_gain([1.0] * 50 + [0.0] * 50, [0.5] * 100, paired=False)
    assert -0.12 <= low <= -0.08 and 0.08 <= high <= 0.12
    # A stored row pairs with the chance record when it holds the same ids in the same order.
    record = {"per_instance": [{"id": "a", "successes": [0.0, 1.0]},
                               {"id": "b", "successes": [0.0, 0.0]}], "n": 2, "heldout_sha": "x"}  # fmt: skip
    paired = {"after": 0.5, "n": 2, "per_instance": {"ids": ["a", "b"], "after": [1.0, 0.0]}}
    gain, low, high = chance.gain_over_chance(paired, record)
    assert gain == pytest.approx(0.5 - 0.25)
    # A result from before fingerprints: changed when the id-only split held out other instances.
    old = {"n": 2, "after": 0.5}
    assert not efficacy.heldout_changed(old, {**record, "id_split_sha": "x"})
    assert efficacy.heldout_changed(old, {**record, "id_split_sha": "y"})
    assert efficacy.heldout_changed({**old, "heldout_sha": "z"}, record)
    assert efficacy.heldout_changed({"n": 3, "after": 0.5}, record)


def test_chance_only_plays_the_env_policies_without_a_model(
    efficacy: ModuleType, tmp_path: Path
) -> None:
    """`--chance-only` on frozenlake (3 instances, 2 random episodes each): the random legal
    policy and the solver through the engine, per-instance results stored, the columns filled."""
    chance, out = tmp_path / "chance.jsonl", tmp_path / "efficacy.md"
    argv = ["efficacy.py", "--chance-only", "--rows", "frozenlake", "--n", "3",
            "--chance-episodes", "2", "--chance-results", str(chance), "--out", str(out),
            "--results", str(tmp_path / "none.jsonl")]  # fmt: skip
    run_efficacy(efficacy, argv)
    random_policy, solver = [json.loads(line) for line in chance.read_text().splitlines()]
    assert random_policy["policy"] == "random" and solver["policy"] == "scripted"
    assert [len(p["successes"]) for p in random_policy["per_instance"]] == [2, 2, 2]
    assert solver["success"] == 1.0  # a shortest safe path on unslippery ice always arrives
    assert random_policy["tries"] == 1 and "--chance-only" in random_policy["command"]
    line = next(li for li in out.read_text().splitlines()
                if li.startswith("| frozenlake 4x4, not slippery |"))  # fmt: skip
    assert f"| {random_policy['success']:.1%} | 100.0% |" in line


@pytest.mark.slow
def test_one_row_end_to_end_on_the_tiny_model(efficacy: ModuleType, tmp_path: Path) -> None:
    """Before, train, after and the rendered table, with the tiny model standing in for SmolLM2
    (pinned fp32: model.bf16 off). The numbers are the tiny model's; what is checked is that the
    row is measured on the held-out instances and lands in the table with its command."""
    results, out = tmp_path / "results.jsonl", tmp_path / "efficacy.md"
    argv = [
        "efficacy.py", "--rows", "arithmetic", "--n", "6", "--k", "2", "--budget-minutes", "5",
        "--runs-dir", str(tmp_path / "runs"), "--results", str(results), "--out", str(out),
        "--set", "model.name=tiny-random", "--set", "model.bf16='off'",
        "--set", "train.steps=2", "--set", "sampling.max_new_tokens=6",
    ]  # fmt: skip
    run_efficacy(efficacy, argv)
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["row"] == "arithmetic" and row["n"] == 6 and row["steps"] == 2
    assert 0.0 <= row["before"] <= 1.0 and 0.0 <= row["after"] <= 1.0
    assert row["gain_ci95"][0] <= row["gain"] <= row["gain_ci95"][1]
    assert row["mean@2_before"] is not None and row["k"] == 2
    # The base's real per-instance results went to the cache beside the runs dir, unchanged.
    assert row["base"].startswith("scored (stored as ")
    (entry,) = [json.loads(f.read_text()) for f in (tmp_path / "efficacy-cache").glob("*.json")]
    assert statistics.fmean(entry["scores"]["pass1"]) == row["before"]
    assert entry["scores"]["mean@2"] == row["mean@2_before"] and len(entry["ids"]) == 6
    table = out.read_text()
    assert "| arithmetic, 2-digit addition (the demo) | >= 80% in <= 10 min | pass@1 | 6 |" in table
    assert "--set model.name=tiny-random" in table  # the command that produced the row
    assert (
        "| calculator, 1 operation | >= 90%, tool used in >= 95% | pass@1 | not measured yet |"
        in table
    )


@pytest.mark.slow
def test_a_warmup_row_reports_the_warmup_apart(efficacy: ModuleType, tmp_path: Path) -> None:
    """frozenlake-warmup on the tiny model: the pipeline's SFT format warm-up (env demos), then
    RL; the row has the warm-up's own held-out number, RL's gain over it, and minutes that count
    both. The tiny model's numbers mean nothing; the bookkeeping is what is checked."""
    results, out = tmp_path / "results.jsonl", tmp_path / "efficacy.md"
    argv = [
        "efficacy.py", "--rows", "frozenlake-warmup", "--n", "3", "--k", "1",
        "--budget-minutes", "5", "--runs-dir", str(tmp_path / "runs"), "--results", str(results),
        "--out", str(out), "--set", "model.name=tiny-random", "--set", "model.bf16='off'",
        "--set", "train.steps=1", "--set", "rollout.max_turns=2",
        "--warmup-set", "train.steps=2", "--warmup-set", "train.max_length=4096",
        "--warmup-set", "env_demos.episodes=6",  # the demos stage's key, not its config's
    ]  # fmt: skip
    # The clone once (--warmup-only), then the RL arm and its placebo arm both from it.
    clone = tmp_path / "clone"
    run_efficacy(efficacy, [*argv, "--warmup-only", "--runs-dir", str(clone)])
    assert not results.exists()  # a warm-up alone is no row
    (marker,) = (clone / "frozenlake-warmup").glob("*/stage.json")
    run_efficacy(efficacy, [*argv, "--warmup-from", str(clone / "frozenlake-warmup"), "--placebo"])
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    for arm in (
        tmp_path / "runs" / "frozenlake-warmup",
        tmp_path / "runs" / "placebo" / "frozenlake-warmup",
    ):
        # Each arm reused the clone's finished stage ("done earlier"): its model is the clone's.
        assert (arm / marker.parent.name / "stage.json").read_text() == marker.read_text()
        assert not (arm / marker.parent.name / "model").exists()
    assert row["placebo"]["recipe"]["placebo"] == "shuffle_within_group"
    assert row["recipe"]["placebo"] == "none" and row["recipe"]["learning_rate"] > 0
    assert row["over_placebo"] == pytest.approx(row["after"] - row["after_placebo"])
    assert row["over_placebo_ci95"][0] <= row["over_placebo"] <= row["over_placebo_ci95"][1]
    assert len(row["per_instance"]["after_placebo"]) == 3
    # The per-step signal of each arm's one RL step, stored with the result.
    for steps in (row["per_step"], row["placebo"]["per_step"]):
        (step,) = steps
        assert step["step"] == 1 and step["signal/episodes"] == row["recipe"]["episodes_per_step"]
        assert 0 <= step["signal/groups_success_contrast"] <= step["signal/groups"]
        assert "learning_rate" in step and "signal/kept_all_equal_frac" in step
    assert row["recipe"]["episodes"] == row["per_step"][0]["signal/episodes"]
    assert "--placebo" in row["command"] and "--warmup-from" in row["command"]
    assert row["row"] == "frozenlake-warmup" and row["n"] == 3 and row["steps"] == 1
    assert 0.0 <= row["after_warmup"] <= 1.0
    assert row["rl_gain"] == pytest.approx(row["after"] - row["after_warmup"])
    assert row["rl_gain_ci95"][0] <= row["rl_gain"] <= row["rl_gain_ci95"][1]
    assert 0 < row["warmup_minutes"] <= row["train_minutes"]
    assert 0 < row["warmup_metrics"]["demos/rows"] <= 6  # the example plays 128
    assert "--warmup-set train.steps=2" in row["command"]
    assert "--warmup-set env_demos.episodes=6" in row["command"]
    table = out.read_text()
    line = next(li for li in table.splitlines() if li.startswith("| frozenlake 4x4, not slippery;"))
    assert "RL alone" in line and "placebo after" in line and "/step" in line
    assert line.count("|") == 23  # 22 columns


def test_an_env_demos_key_needs_a_stage_that_plays_demos(
    efficacy: ModuleType, tmp_path: Path
) -> None:
    """`--warmup-set env_demos.KEY` goes to the stage with env_demos; a pipeline without one
    (examples/pipeline.yaml: SFT on a data file, DPO, GRPO) is told so before anything runs:
    the row's earlier run directory is left where it was."""
    row = efficacy.Row("p", "a pipeline without demos", "pipeline.yaml", "-", pipeline=True)
    (tmp_path / "p").mkdir()
    with pytest.raises(SystemExit, match=r"env_demos\.episodes=6: pipeline\.yaml has no env_demos"):
        efficacy.measure_warmup(row, 1.0, 3, 1, tmp_path, [], ["env_demos.episodes=6"])
    assert [d.name for d in tmp_path.iterdir()] == ["p"]


# ---------------------------------------------------------------- the base model's results, cached
# A fake model directory (what the key hashes is its files; nothing loads it) and a fake scorer
# standing in for efficacy.score_base, counting its calls: the cache is what these tests check.


class FakeScorer:
    """efficacy.score_base's stand-in: one result per held-out instance, and the rest."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model: str, cfg: Any, n: int, k: int) -> dict[str, Any]:
        self.calls += 1
        count = min(n, cfg.task.env.num_heldout)
        out: dict[str, Any] = {
            "n": count,
            "pass1": [float(i % 3 == 0) for i in range(count)],
            "tool_call_rate": 1 / 3,  # a float JSON must give back bit for bit
            "turns": 2.7,
            "errors": 0,
        }
        if k > 1:
            out[f"mean@{k}"] = 0.1 + 1 / 7
        return out


@pytest.fixture()
def fake_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights v1")
    return model


@pytest.fixture()
def scorer(efficacy: ModuleType, monkeypatch: pytest.MonkeyPatch) -> FakeScorer:
    fake = FakeScorer()
    monkeypatch.setattr(efficacy, "score_base", fake)
    return fake


def lake_config(model: Path, *sets: str) -> Any:
    """env_frozenlake.yaml (the frozenlake row) on the fake model, with few instances."""
    from rlvr.config import load_config

    few = [
        "task.env.num_train=20",
        "task.env.num_heldout=12",
        f"model.name={model}",
        "model.bf16=off",
    ]
    return load_config(ROOT / "examples" / "env_frozenlake.yaml", [*few, *sets])


def base(
    efficacy: ModuleType, cfg: Any, model: Path, cache: Path, n: int = 8, k: int = 2, **kw: Any
) -> tuple[dict[str, Any], str]:
    """efficacy.base_scores for the frozenlake row; `refresh=True` is `--no-base-cache`."""
    row = efficacy.BY_NAME["frozenlake"]
    where = efficacy.base_cache.Cache(cache, **kw)
    return efficacy.base_scores(row, cfg, str(model), n, k, where)


def test_a_second_run_with_the_same_key_reads_the_cache(
    efficacy: ModuleType, scorer: FakeScorer, fake_model: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    fresh, how = base(efficacy, lake_config(fake_model), fake_model, cache)
    assert scorer.calls == 1 and how.startswith("scored (stored as ")
    (entry,) = cache.glob("*.json")
    again, how = base(efficacy, lake_config(fake_model), fake_model, cache)
    assert scorer.calls == 1  # the base was not scored again
    assert how == f"cached ({entry.stem[:12]})" and again == fresh
    # What a re-measurement changes (training hyper-parameters, the time budget) is not in the key,
    # nor is the temperature when no sample is drawn (k = 1: greedy only); touching the weights'
    # file without changing it is not a change either (the key hashes contents, not dates).
    tuned = lake_config(fake_model, "train.learning_rate=1e-3", "objective.beta=0.3",
                        "train.steps=3", "sampling.group_size=4", "train.time_limit_minutes=9")  # fmt: skip
    os.utime(fake_model / "model.safetensors", (1e9, 1e9))
    assert base(efficacy, tuned, fake_model, cache)[1].startswith("cached (")
    base(efficacy, lake_config(fake_model), fake_model, cache, k=1)
    hot = lake_config(fake_model, "sampling.temperature=0.3")
    assert base(efficacy, hot, fake_model, cache, k=1)[1].startswith("cached (")
    assert scorer.calls == 2


def test_the_seeds_of_a_row_share_one_base(
    efficacy: ModuleType, fake_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base is one model whatever seed a run trains with: it is scored (its mean@k sampled)
    under seed 0 and cached so, and a run on seed 3 reads that entry."""
    seeds_scored: list[int] = []

    def scorer(model: str, cfg: Any, n: int, k: int) -> dict[str, Any]:
        seeds_scored.append(cfg.train.seed)
        return FakeScorer()(model, cfg, n, k)

    monkeypatch.setattr(efficacy, "score_base", scorer)
    cache = tmp_path / "cache"
    first, how = base(efficacy, lake_config(fake_model, "train.seed=3"), fake_model, cache)
    assert seeds_scored == [0] and how.startswith("scored (stored as ")
    again, how = base(efficacy, lake_config(fake_model), fake_model, cache)
    assert seeds_scored == [0] and how.startswith("cached (") and again == first


@pytest.mark.parametrize(
    ("change", "sets", "n", "k"),
    [
        ("n", (), 9, 2),
        ("k", (), 8, 3),
        ("max new tokens", ("sampling.max_new_tokens=17",), 8, 2),
        ("eval max new tokens", ("eval.max_new_tokens=33",), 8, 2),
        ("stop strings", ("sampling.stop=['</answer>']",), 8, 2),
        ("temperature of mean@k", ("sampling.temperature=0.5",), 8, 2),
        ("max turns", ("rollout.max_turns=2",), 8, 2),
        ("tool format", ("rollout.tool_format=hermes",), 8, 2),
        ("bf16", ("model.bf16=on",), 8, 2),
        ("decode path", ("generator.decode=fast",), 8, 2),
        ("env option", ("task.env.options.slippery=true",), 8, 2),
    ],
)
def test_a_changed_key_part_scores_the_base_again(
    efficacy: ModuleType,
    scorer: FakeScorer,
    fake_model: Path,
    tmp_path: Path,
    change: str,
    sets: tuple[str, ...],
    n: int,
    k: int,
) -> None:
    cache = tmp_path / "cache"
    base(efficacy, lake_config(fake_model), fake_model, cache)
    _, how = base(efficacy, lake_config(fake_model, *sets), fake_model, cache, n=n, k=k)
    assert scorer.calls == 2 and how.startswith("scored (stored as "), change
    assert len(list(cache.glob("*.json"))) == 2


def test_changed_model_weights_score_the_base_again(
    efficacy: ModuleType, scorer: FakeScorer, fake_model: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    base(efficacy, lake_config(fake_model), fake_model, cache)
    (fake_model / "model.safetensors").write_bytes(b"weights v2")  # same name, same size
    os.utime(fake_model / "model.safetensors", ns=(10**18, 10**18))
    _, how = base(efficacy, lake_config(fake_model), fake_model, cache)
    assert scorer.calls == 2 and how.startswith("scored (")
    (fake_model / "tokenizer.json").write_text("{}")  # a file more: another model too
    base(efficacy, lake_config(fake_model), fake_model, cache)
    assert scorer.calls == 3


def test_no_base_cache_scores_again_and_replaces_the_entry(
    efficacy: ModuleType, scorer: FakeScorer, fake_model: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    base(efficacy, lake_config(fake_model), fake_model, cache)
    _, how = base(efficacy, lake_config(fake_model), fake_model, cache, refresh=True)
    assert scorer.calls == 2 and how.startswith("scored (--no-base-cache; stored as ")
    assert base(efficacy, lake_config(fake_model), fake_model, cache)[1].startswith("cached (")
    assert scorer.calls == 2 and len(list(cache.glob("*"))) == 1


def test_a_model_not_on_disk_is_never_cached(
    efficacy: ModuleType, scorer: FakeScorer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub id: what its weights are is not known here, so the base is scored every time."""
    import rlvr.models

    monkeypatch.setattr(rlvr.models, "check_hub_model", lambda name: None)
    cfg = lake_config(Path("some-org/some-model"))
    for _ in range(2):
        _, how = base(efficacy, cfg, Path("some-org/some-model"), tmp_path / "cache")
        assert how.startswith("scored (not cached: model some-org/some-model is not a directory")
    assert scorer.calls == 2 and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("damage", ["truncated", "one result short", "not an object"])
def test_a_corrupt_cache_file_is_ignored_with_a_one_line_warning(
    efficacy: ModuleType,
    scorer: FakeScorer,
    fake_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    cache = tmp_path / "cache"
    fresh, _ = base(efficacy, lake_config(fake_model), fake_model, cache)
    (entry,) = cache.glob("*.json")
    text = entry.read_text()
    if damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "one result short":
        data = json.loads(text)
        data["scores"]["pass1"].pop()
        entry.write_text(json.dumps(data))
    else:
        entry.write_text("[1, 2]")
    capsys.readouterr()
    again, how = base(efficacy, lake_config(fake_model), fake_model, cache)
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: base cache {entry} ignored")
    assert scorer.calls == 2 and how.startswith("scored (stored as ") and again == fresh
    assert base(efficacy, lake_config(fake_model), fake_model, cache)[1].startswith("cached (")


def test_the_bootstrap_from_cached_results_equals_the_fresh_one(
    efficacy: ModuleType, scorer: FakeScorer, fake_model: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    fresh, _ = base(efficacy, lake_config(fake_model), fake_model, cache, n=12)
    cached, how = base(efficacy, lake_config(fake_model), fake_model, cache, n=12)
    assert how.startswith("cached (") and scorer.calls == 1
    after = [float(i % 2 == 0) for i in range(12)]
    assert cached["pass1"] == fresh["pass1"]  # the same instances in the same order
    ci = efficacy.paired_bootstrap_ci
    assert ci(cached["pass1"], after) == ci(fresh["pass1"], after)
    assert cached == fresh  # every number, to the bit (mean@k, tool-call rate)


def fake_training(efficacy: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Training, loading and scoring trained models replaced by fakes; returns the policies that
    per_instance_scores was asked to score (never the base: that goes through score_base)."""
    import rlvr.evaluate_cli
    import rlvr.models
    import rlvr.observe.tracking
    import rlvr.pipeline
    import rlvr.train.loop

    scored: list[Any] = []

    def after(policy: Any, cfg: Any, config_dir: Path, n: int, k: int) -> dict[str, Any]:
        scored.append(policy)
        return FakeScorer()("trained", cfg, n, k) | {"pass1": [1.0] * min(n, 12)}

    def pipeline(cfg: Any, config_dir: Path, stop_before: str | None = None) -> list[Any]:
        warm = {"wall_minutes": 0.5, "model_dir": "warm-model", "metrics": {"demos/rows": 4}}
        return [{"metrics": {}}, warm] + ([] if stop_before else [{"wall_minutes": 1.0}])

    monkeypatch.setattr(efficacy, "per_instance_scores", after)
    monkeypatch.setattr(rlvr.train.loop, "train", lambda cfg, **_: SimpleNamespace(steps_done=3))
    monkeypatch.setattr(rlvr.evaluate_cli, "load_model", lambda path: (f"trained:{path}", None))
    monkeypatch.setattr(rlvr.models, "load_policy", lambda name: f"loaded:{name}")
    monkeypatch.setattr(rlvr.pipeline, "run_pipeline", pipeline)
    monkeypatch.setattr(
        rlvr.observe.tracking, "read_metrics", lambda path: [{"step": 1, "loss": 0}]
    )
    return scored


@pytest.mark.parametrize("row_name", ["frozenlake", "frozenlake-warmup"])
def test_a_row_says_its_base_came_from_the_cache(
    efficacy: ModuleType,
    scorer: FakeScorer,
    fake_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    row_name: str,
) -> None:
    """main() twice on one row (training faked): the second run's output and JSONL line say the
    base was cached; a warm-up row's SFT model is scored every time (only the base is cached);
    --no-base-cache scores the base again."""
    scored = fake_training(efficacy, monkeypatch)
    results = tmp_path / "results.jsonl"
    argv = [
        "efficacy.py", "--rows", row_name, "--n", "8", "--k", "2", "--runs-dir",
        str(tmp_path / "runs"), "--results", str(results), "--out", str(tmp_path / "table.md"),
        "--set", f"model.name={fake_model}", "--set", "task.env.num_train=20",
        "--set", "task.env.num_heldout=12", "--set", "model.bf16='off'",
    ]  # fmt: skip
    for _ in range(2):
        run_efficacy(efficacy, argv)
    run_efficacy(efficacy, [*argv, "--no-base-cache"])
    first, second, third = [json.loads(line) for line in results.read_text().splitlines()]
    (entry,) = (tmp_path / "efficacy-cache").glob("*.json")  # the default: beside --runs-dir
    prefix = entry.stem[:12]
    assert first["base"] == f"scored (stored as {prefix})"
    assert second["base"] == f"cached ({prefix})"
    assert third["base"] == f"scored (--no-base-cache; stored as {prefix})"
    assert f"[{row_name}] base: cached ({prefix})" in capsys.readouterr().out
    assert scorer.calls == 2  # runs 1 and 3
    assert first["gain_ci95"] == second["gain_ci95"] and first["before"] == second["before"]
    warm = [p for p in scored if p == "loaded:warm-model"]
    assert len(warm) == (3 if row_name.endswith("warmup") else 0)
    assert len(scored) - len(warm) == 3  # the trained model, every run


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        ([], "fp32"),
        (["generator.decode=fast"], "fp32; sampling: own decode, fp32 copy"),
        (
            ["generator.decode=fast", "generator.decode_dtype=bfloat16"],
            "fp32; sampling: own decode, bf16 copy",
        ),
        (["generator.decode=hf", "generator.decode_dtype=bfloat16"], "fp32"),  # no copy on hf
        (["generator.decode_dtype=bfloat16"], "fp32; sampling: own decode, bf16 copy"),  # auto
    ],
)
def test_precision_column_names_the_sampling_copy(
    efficacy: ModuleType, sets: list[str], expected: str
) -> None:
    """A row sampled from a bf16 copy says so: learning under that copy is what it measures."""
    from rlvr.config import load_config

    cfg = load_config(ROOT / "examples" / "quickstart.yaml", ["model.bf16=off", *sets])
    assert efficacy.precision_text(cfg) == expected


def test_precision_column_reads_what_the_run_logged(efficacy: ModuleType, tmp_path: Path) -> None:
    """`model.bf16: auto` is measured for the model the RL run trained (for a warm-up row, a stage's
    output the row's config does not name): the run's `perf/precision` is the truth."""
    from rlvr.config import load_config

    cfg = load_config(ROOT / "examples" / "quickstart.yaml", ["model.bf16=off"])
    for bits, expected in ((16.0, "bf16 autocast"), (32.0, "fp32")):
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "perf/precision": bits}))
        assert efficacy.precision_text(cfg, tmp_path) == expected
    assert efficacy.precision_text(cfg, tmp_path / "missing") == "fp32"


def test_every_row_config_loads_with_its_overrides(efficacy: ModuleType) -> None:
    """A typo in a row's override would otherwise surface minutes into a measurement."""
    from rlvr.config import load_config
    from rlvr.pipeline import first_rl_config, load_pipeline_config

    for row in efficacy.ROWS:
        path = efficacy.EXAMPLES / row.config
        sets = [*row.overrides, *efficacy.RL_RUN_OVERRIDES]
        if row.pipeline:
            stages = load_pipeline_config(path).stages
            rl = next(i for i, s in enumerate(stages) if s.kind == "rl")
            cfg = first_rl_config(
                load_pipeline_config(path, [f"stages.{rl}.config.{e}" for e in sets]),
                efficacy.EXAMPLES,
            )
        else:
            cfg = load_config(path, sets)
        assert cfg is not None, row.name
        assert cfg.task.source == ("env" if row.name != "arithmetic" else "arithmetic"), row.name
        if "slippery" in row.name:
            assert cfg.task.env.options["slippery"] is True, row.name
        credit = row.name.rsplit("-", 1)[-1]
        if credit in ("gigpo", "turn"):  # the credit rows differ from their baseline only there
            assert cfg.objective.credit == credit and cfg.objective.gamma == 0.95, row.name


def test_a_row_left_unrun_on_purpose_says_why(efficacy: ModuleType) -> None:
    """An unmeasured row prints the reason it is not run (or `not measured yet`); a result, once
    there is one, replaces the reason."""
    first = "| sokoban, smallest room (5x5, 1 box) |"

    def sokoban_line(table: str) -> str:
        (line,) = [line for line in table.splitlines() if line.startswith(first)]
        return line

    reason = "| not run: bare SmolLM2 wrote the answer format in 0 of 32 first turns of sokoban"
    assert reason in sokoban_line(efficacy.render([]))
    unrun = [row.name for row in efficacy.ROWS if row.not_run]
    assert set(unrun) == {"frozenlake-slippery", "sokoban", "countdown", "sudoku"}
    assert all(f"{name}-warmup" in efficacy.BY_NAME for name in unrun)  # what measures the task
    measured = {
        "row": "sokoban", "task": "sokoban, smallest room (5x5, 1 box)", "target": "+15 points",
        "n": 200, "before": 0.0, "after": 0.02, "gain": 0.02, "gain_ci95": [0.0, 0.04], "k": 1,
        "tool_call_rate_after": 0.0, "turns_after": 8.0, "steps": 9, "train_minutes": 25.0,
        "met": False, "cpu": "x", "command": "c",
    }  # fmt: skip
    line = sokoban_line(efficacy.render([measured]))
    assert "not run" not in line and "| 200 |  |  | 0.0% |  | 2.0% |" in line


def test_a_row_that_is_not_an_env_says_so_in_its_chance_cells(efficacy: ModuleType) -> None:
    """The demo's arithmetic task has no legal moves to draw at random, so its chance and solver
    cells say so rather than stand empty, which reads as "not measured"; env rows without a
    chance record yet stay empty."""
    results = [seed_result(0, [1.0, 1.0, 0.0, 0.0])]
    line = next(li for li in efficacy.render(results).splitlines() if li.startswith("| arithmetic"))
    assert "| 4 | not an env: no legal moves | not an env: no legal moves | 25.0% |" in line
    line = next(
        li
        for li in efficacy.render([]).splitlines()
        if li.startswith("| frozenlake 4x4, not slippery |")
    )
    assert "| not measured yet |  |  |" in line


def seed_result(seed: int | None, after: list[float], command_tail: str = "", **more: Any) -> dict:
    """A row result as efficacy.py writes it, for the arithmetic row on 4 instances (no chance
    record: arithmetic has no env), `seed` None standing for a result from before seeds were
    recorded."""
    before = [0.0, 0.0, 1.0, 0.0]
    seed_args = "" if seed is None else f" --set train.seed={seed}"
    result = {
        "row": "arithmetic", "task": "arithmetic, 2-digit addition (the demo)",
        "target": ">= 80% in <= 10 min", "n": 4, "k": 2, "before": statistics.fmean(before),
        "after": statistics.fmean(after), "gain": statistics.fmean(after) - 0.25,
        "gain_ci95": [0.0, 0.5], "mean@2_before": 0.25, "mean@2_after": statistics.fmean(after),
        "tool_call_rate_after": 0.0, "turns_after": 1.0, "steps": 30, "train_minutes": 5.0,
        "cpu": "test CPU", "precision": "fp32", "date": "2026-12-04", "heldout_sha": "abc",
        "per_instance": {"ids": ["a", "b", "c", "d"], "before": before, "after": after},
        "command": "python benchmarks/efficacy.py --rows arithmetic --budget-minutes 10 --n 4 "
        f"--k 2{command_tail}{seed_args}",
        **more,
    }  # fmt: skip
    if seed is not None:
        result["seed"] = seed
    return result


def test_a_row_on_three_seeds_shows_their_mean_and_spread(efficacy: ModuleType) -> None:
    """The newest result of each seed measured the same way is averaged per instance; an older
    run of a seed, and a seed measured with another command, are not. Worked by hand."""
    import _efficacy_seeds as seeds

    results = [
        seed_result(1, [0.0, 0.0, 0.0, 0.0]),  # replaced by seed 1's newer run below
        seed_result(None, [1.0, 1.0, 0.0, 0.0], train_minutes=6.0),  # seed 0 (the config's)
        seed_result(1, [1.0, 0.0, 1.0, 1.0]),
        seed_result(3, [1.0, 1.0, 1.0, 1.0], " --set train.steps=60"),  # another series
        seed_result(2, [1.0, 1.0, 1.0, 0.0], steps=29),
    ]
    series = seeds.newest_series(results, "arithmetic")
    assert [seeds.seed_of(r) for r in series] == [0, 1, 2]
    combined = seeds.combine(series, results[-1])
    # Per instance: a (1+1+1)/3, b (1+0+1)/3, c (0+1+1)/3, d (0+1+0)/3.
    assert combined["per_instance"]["after"] == pytest.approx([1.0, 2 / 3, 2 / 3, 1 / 3])
    assert combined["after"] == pytest.approx(2 / 3)  # the seeds' afters: 0.5, 0.75, 0.75
    assert combined["gain"] == pytest.approx(2 / 3 - 0.25)
    low, high = combined["gain_ci95"]
    assert low <= combined["gain"] <= high and high - low > 0.0
    steps = [entry["steps"] for entry in combined["seeds"]]
    assert combined["train_minutes"] == 6.0 and steps == [30, 30, 29]
    assert combined["command"].endswith("--k 2 --seeds 0 1 2")
    text = seeds.spread_text(combined)
    assert text == "3 (seeds 0, 1, 2): 50.0 / 75.0 / 75.0%; sd 14.4 pts"
    line = next(li for li in efficacy.render(results).splitlines() if li.startswith("| arithmetic"))
    assert "| 66.7% | 3 (seeds 0, 1, 2): 50.0 / 75.0 / 75.0%; sd 14.4 pts |" in line
    # each seed's steps, (no recipe stored), the slowest seed's minutes
    assert "| 30, 30, 29 |  | 6.0 | no |" in line


@pytest.mark.parametrize(
    "other",
    [{"heldout_sha": "changed"}, {"cpu": "another CPU"}, {"config_sha": "yaml edited"},
     {"overrides": ["sampling.temperature=0.7"]}],
)  # fmt: skip
def test_seeds_measured_otherwise_are_not_averaged(efficacy: ModuleType, other: dict) -> None:
    """A seed measured on another held-out set, on another CPU (its minutes and steps are
    another machine's), or from another recipe (the row's yaml or overrides changed, its command
    did not) is another series: the newest stands alone."""
    import _efficacy_seeds as seeds

    results = [seed_result(0, [1.0, 1.0, 1.0, 1.0]), seed_result(1, [0.0, 0.0, 0.0, 1.0], **other)]
    series = seeds.newest_series(results, "arithmetic")
    assert [seeds.seed_of(r) for r in series] == [1]
    combined = seeds.combine(series, results[-1])
    assert combined["after"] == 0.25 and seeds.spread_text(combined) == "1 (seed 1)"


def test_the_seeds_flag_measures_the_row_once_per_seed(
    efficacy: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--seeds 0 1: two runs of the row, each told its train.seed (every stage of a warm-up row),
    both in the results and averaged in the table."""
    told: list[tuple[list[str], list[str] | None]] = []

    def fake_measure(row: Any, budget: float, n: int, k: int, runs: Path, extra: list[str],
                     cache: Any = None) -> dict:  # fmt: skip
        told.append((extra, None))
        seed = int(extra[-1].split("=")[1])
        assert runs == tmp_path / "runs" / f"seed-{seed}"  # each seed's run kept apart
        return seed_result(seed, [1.0, 0.0, 0.0, 0.0] if seed == 0 else [1.0, 1.0, 0.0, 0.0])

    def fake_warmup(row: Any, budget: float, n: int, k: int, runs: Path, extra: list[str],
                    warmup_extra: list[str], cache: Any = None,
                    warmup_from: Any = None) -> dict:  # fmt: skip
        told.append((extra, warmup_extra))
        return {**seed_result(int(extra[-1].split("=")[1]), [0.0] * 4), "row": row.name}

    monkeypatch.setattr(efficacy, "measure", fake_measure)
    monkeypatch.setattr(efficacy, "measure_warmup", fake_warmup)
    results, out = tmp_path / "results.jsonl", tmp_path / "efficacy.md"
    run_efficacy(efficacy, [
        "efficacy.py", "--rows", "arithmetic", "calculator-1op-warmup", "--seeds", "0", "1",
        "--results", str(results), "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
        "--set", "train.steps=3", "--warmup-set", "train.steps=2",
    ])  # fmt: skip
    assert told == [
        (["train.steps=3", "train.seed=0"], None),
        (["train.steps=3", "train.seed=1"], None),
        (["train.steps=3", "train.seed=0"], ["train.steps=2", "train.seed=0"]),
        (["train.steps=3", "train.seed=1"], ["train.steps=2", "train.seed=1"]),
    ]
    assert len(results.read_text().splitlines()) == 4
    assert "| 37.5% | 2 (seeds 0, 1): 25.0 / 50.0%; sd 17.7 pts |" in out.read_text()


def test_config_sha_follows_the_row_yaml_and_the_stage_file_it_names(
    efficacy: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm-up row's recipe is its pipeline yaml and the RL stage's `file:`: a value edited in
    either changes config_sha (so old seeds leave the series); a comment edited does not."""
    monkeypatch.setattr(efficacy, "EXAMPLES", tmp_path)
    (tmp_path / "rl.yaml").write_text("train: {steps: 10}\n")
    (tmp_path / "warm.yaml").write_text("stages:\n  - {name: rl, kind: rl, file: rl.yaml}\n")
    row = efficacy.Row("r", "task", "warm.yaml", "t", pipeline=True)
    first = efficacy.config_sha(row)
    assert efficacy.config_sha(row) == first and len(first) == 64
    (tmp_path / "rl.yaml").write_text("train: {steps: 11}\n")
    second = efficacy.config_sha(row)
    assert second != first
    (tmp_path / "warm.yaml").write_text(
        "# a comment\nstages:\n  - {name: rl, kind: rl, file: rl.yaml}\n"
    )
    assert efficacy.config_sha(row) == second
    (tmp_path / "warm.yaml").write_text("stages:\n  - {name: rl, kind: rl, file: rl.yaml, x: 1}\n")
    assert efficacy.config_sha(row) not in (first, second)
