"""The whole loop on the scale-out paths: async rollouts and the server generator backend (the vLLM
protocol, served here by `rlvr serve`), through `train()` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlvr.build import use_bf16
from rlvr.config import RunConfig, load_config
from rlvr.models import load_policy
from rlvr.precision import logprob_gap_tolerance, native_bf16
from rlvr.serve.app import create_app
from rlvr.serve.runner import BackgroundServer, serve_state
from rlvr.train.loop import train

# Runs the loop with model.bf16: auto, so its numbers depend on the CPU kind (tests/conftest.py).
pytestmark = pytest.mark.precision


def _gap_tolerance(cfg: RunConfig) -> float:
    """The sampler/trainer log-prob gap rounding explains at the precision this run resolved (fp32:
    1e-4; bf16 autocast in the trainer: 2^-8, rlvr.precision). Staleness or a missed weight sync
    shows as a gap many times larger (0.1-0.2 on the tiny model after one update)."""
    return logprob_gap_tolerance(use_bf16(cfg.model))


def _rows(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _tiny(tiny_config_dir: Path, tiny_model_dir: Path, run_dir: Path, *more: str):  # type: ignore[no-untyped-def]
    return load_config(
        tiny_config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={run_dir}",
            "tracking.progress=false",
            "eval.at_start=false",
            "eval.n=4",
            *more,
        ],
    )


def test_async_rollouts_through_the_loop_and_resume(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Async rollouts sample round k from weights one update old. Precision: model.bf16 auto; the
    on-policy first step's gap must be rounding (`_gap_tolerance`), the stale ones ten times that."""
    run_dir = tmp_path / "async"
    cfg = _tiny(
        tiny_config_dir, tiny_model_dir, run_dir,
        "rollout.async_rollouts=true", "train.steps=4", "checkpoint.every=2",
    )  # fmt: skip
    assert cfg.objective.tis_cap == 2.0  # importance weighting on by default with async
    train(cfg, config_dir=tiny_config_dir)
    rows = _rows(run_dir)
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/weights_version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
    # Off-policy from step 2 on: the sampling copy lags one update, the IS weights correct for it.
    tolerance = _gap_tolerance(cfg)
    assert rows[0]["update/behaviour_logprob_abs_diff"] < tolerance
    assert all(r["update/behaviour_logprob_abs_diff"] > 10 * tolerance for r in rows[1:])
    assert all("update/tis_weight_mean" in r for r in rows)
    resumed = train(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 6})}),
        resume=True,
        config_dir=tiny_config_dir,
    )
    assert resumed.steps_done == 6
    after = _rows(run_dir)[4:]
    assert [r["async/staleness"] for r in after] == [0.0, 1.0]


def test_server_backend_syncs_weights_after_every_update(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The generator is a server speaking vLLM's protocol (here `rlvr serve`'s in-process app over its
    own copy of the model). With weight sync the server samples from the trained weights: the
    behaviour log-probs match the trainer's; with sync off they drift apart after the first update.
    Precision: model.bf16 auto (the server samples in fp32); tolerance from `_gap_tolerance`."""
    gaps = {}
    for sync in ("full", "none"):
        server_policy = load_policy(str(tiny_model_dir))
        with BackgroundServer(
            create_app(serve_state(server_policy, str(tiny_model_dir)), open_admin=True)
        ) as srv:
            run_dir = tmp_path / sync
            cfg = _tiny(
                tiny_config_dir, tiny_model_dir, run_dir, "train.steps=3",
                "generator.backend=server", f"generator.url={srv.base_url}",
                f"generator.weight_sync={sync}", "eval.at_end=false",
            )  # fmt: skip
            assert cfg.objective.tis_cap == 2.0  # another engine samples: truncated IS on
            train(cfg, config_dir=tiny_config_dir)
            gaps[sync] = [r["update/behaviour_logprob_abs_diff"] for r in _rows(run_dir)]
    tolerance = _gap_tolerance(cfg)
    assert max(gaps["full"]) < tolerance, gaps
    assert gaps["none"][0] < tolerance and min(gaps["none"][1:]) > 10 * tolerance, gaps


def test_server_backend_launches_rlvr_serve(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """generator.launch: rlvr starts `rlvr serve` as a subprocess, syncs it, and stops it at the end.
    Precision: model.bf16 auto (the server samples in fp32); tolerance from `_gap_tolerance`."""
    run_dir = tmp_path / "launched"
    cfg = _tiny(
        tiny_config_dir, tiny_model_dir, run_dir, "train.steps=2",
        "generator.backend=server", "generator.launch=rlvr", "eval.at_end=false",
    )  # fmt: skip
    shm = Path("/dev/shm")
    before = set(shm.glob("rlvr-sync-*")) if shm.is_dir() else set()
    train(cfg, config_dir=tiny_config_dir)
    rows = _rows(run_dir)
    tolerance = _gap_tolerance(cfg)
    assert len(rows) == 2 and max(r["update/behaviour_logprob_abs_diff"] for r in rows) < tolerance
    assert (run_dir / "generator_server.log").exists()
    # Each step's sync logged; rlvr serve runs fp32, so its syncs are fp32 (4 bytes a weight).
    weights = sum(p.numel() for p in load_policy(str(tiny_model_dir)).model.parameters())
    assert all(r["sync/weight_bytes"] >= 4 * weights for r in rows), rows
    assert all(r["sync/weight_seconds"] > 0 for r in rows)
    # Launched on this machine: the syncs went to shared memory (it has room for the tiny
    # model), not the run directory, and the folder made for them is gone once the run ended.
    if shm.is_dir():
        assert not (run_dir / "weight_sync").exists()
        assert set(shm.glob("rlvr-sync-*")) <= before


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_trains_the_whole_loop(
    strategy: str, tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`torchrun --nproc_per_node 2 -m rlvr.cli train` (gloo on CPU): each rank plays its share of
    the prompts, the update is data-parallel (or sharded), rank 0 alone writes metrics and the
    checkpoint, and the sampling weights follow the updates (behaviour log-probs = the trainer's).
    Precision: model.bf16 auto, resolved by the ranks as here (RLVR_AUTO_BF16 reaches them)."""
    run_dir = tmp_path / strategy
    cmd = [
        # --tee 3: each rank's stdout and stderr, prefixed, in ours, so a rank's own error shows
        # in the assertion message (torchrun alone reports only its exit signal).
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--tee", "3", "-m", "rlvr.cli", "train", str(tiny_config_dir / "tiny.yaml"),
        "--output-dir", str(run_dir),
        "--set", f"model.name={tiny_model_dir}", "--set", "train.steps=3",
        "--set", "tracking.progress=false", "--set", "checkpoint.every=3", "--set", "eval.n=4",
        "--set", f"distributed.strategy={strategy}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.count("run directory:") == 1  # one summary, from rank 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    tolerance = logprob_gap_tolerance(native_bf16())  # the ranks resolve model.bf16: auto alike
    assert all(r["update/behaviour_logprob_abs_diff"] < tolerance for r in rows)
    assert all(r["update/rows_trained"] == 32 for r in rows)  # the whole round, gathered
    trained = load_policy(str(run_dir / "checkpoints" / "step-000003" / "model")).model
    base = load_policy(str(tiny_model_dir)).model
    with torch.no_grad():
        moved = sum(
            float((a - b).abs().max())
            for a, b in zip(trained.parameters(), base.parameters(), strict=True)
        )
    assert moved > 0


def test_a_failed_start_stops_the_launched_server(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A run that fails after starting its server (here: --resume from a checkpoint whose weights
    load but whose training state is missing, found only once the server runs) stops it."""
    import shutil

    import psutil

    from rlvr.errors import RlvrError

    cfg = _tiny(
        tiny_config_dir, tiny_model_dir, tmp_path / "broken", "generator.backend=server",
        "generator.launch=rlvr",
    )  # fmt: skip
    # Weights (read before the server starts) but no RNG or optimizer state (read after).
    checkpoint = tmp_path / "broken" / "checkpoints" / "step-000001"
    shutil.copytree(tiny_model_dir, checkpoint / "model")
    (checkpoint / "state.json").write_text("{}")
    with pytest.raises(RlvrError, match=r"has no rng\.json"):
        train(cfg, resume=True, config_dir=tiny_config_dir)
    servers = [
        p for p in psutil.Process().children(recursive=True) if "serve" in " ".join(p.cmdline())
    ]
    assert not servers, [p.cmdline() for p in servers]


def test_external_agents_on_a_server_backend(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """ART's layout: the user's agent talks to rlvr's chat endpoint (recording), generation runs on a
    vLLM-protocol server synced after every update. The recordings carry the server's log-probs and
    they match the trainer's (the sync works under the external path too). Precision: model.bf16
    auto (the server samples in fp32); tolerance from `_gap_tolerance`."""
    root = Path(__file__).resolve().parent.parent / "examples" / "byo_agent"
    for name in ("tiny.yaml", "tiny_agent.py"):
        (tmp_path / name).write_text((root / name).read_text())
    server_policy = load_policy(str(tiny_model_dir))
    with BackgroundServer(
        create_app(serve_state(server_policy, str(tiny_model_dir)), open_admin=True)
    ) as srv:
        run_dir = tmp_path / "run"
        cfg = load_config(
            tmp_path / "tiny.yaml",
            [
                f"model.name={tiny_model_dir}", f"output_dir={run_dir}", "tracking.progress=false",
                "train.steps=3", "eval.at_start=false", "eval.at_end=false",
                "generator.backend=server", f"generator.url={srv.base_url}",
            ],
        )  # fmt: skip
        train(cfg, config_dir=tmp_path)
    rows = _rows(run_dir)
    assert [r["external/requests_per_rollout"] for r in rows] == [2.0, 2.0, 2.0]
    assert max(r["update/behaviour_logprob_abs_diff"] for r in rows) < _gap_tolerance(cfg)


def test_combinations_not_supported_are_config_errors() -> None:
    from rlvr.errors import ConfigError

    for combo in (
        ["rollout.async_rollouts=true", "distributed.ray=true"],
        ["rollout.async_rollouts=true", "generator.backend=server", "generator.url=http://x/v1"],
        ["distributed.ray=true", "rollout=external", "external.agent=a.py:f"],
        ["generator.backend=server"],  # neither url nor launch
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, combo)
        # One line: the rule's message, not the whole config echoed back.
        assert "\n" not in str(err.value) and "got {" not in str(err.value)
