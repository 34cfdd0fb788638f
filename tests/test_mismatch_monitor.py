"""The sampler/trainer mismatch monitor (rlvr.observe.mismatch): its threshold per precision, the
rule at and past it, and end to end on a server backend whose weight sync silently does nothing
(the canary fires after the first update) or that is never synced (the behaviour gap fires)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import rlvr.serve.completions as completions
from rlvr.config import RunConfig, bf16_sampling_copy, load_config
from rlvr.models import load_policy
from rlvr.observe.mismatch import (
    BEHAVIOUR_METRIC,
    CANARY_METRIC,
    MismatchSetup,
    mismatch_setup,
    sampler_mismatch,
)
from rlvr.observe.monitors import Monitors
from rlvr.serve.app import create_app
from rlvr.serve.runner import BackgroundServer, serve_state
from rlvr.train.loop import train


def _cfg(**sections: Any) -> RunConfig:
    return RunConfig.model_validate({"model": {"bf16": "off"}, **sections})


def test_the_threshold_follows_the_precision_of_both_sides() -> None:
    fp32 = mismatch_setup(_cfg())
    assert fp32 is not None and (fp32.precision, fp32.threshold) == ("fp32", 1e-3)
    assert fp32.keys == (CANARY_METRIC, BEHAVIOUR_METRIC)
    trainer_bf16 = mismatch_setup(_cfg(model={"bf16": "on"}))
    assert trainer_bf16 is not None and (trainer_bf16.precision, trainer_bf16.threshold) == (
        "bf16",
        0.1,
    )
    # A server by URL may be vLLM in bf16; `rlvr serve` launched by the run samples in fp32.
    url = mismatch_setup(_cfg(generator={"backend": "server", "url": "http://127.0.0.1:1/v1"}))
    assert url is not None and url.precision == "bf16"
    launched = mismatch_setup(_cfg(generator={"backend": "server", "launch": "rlvr"}))
    assert launched is not None and launched.precision == "fp32"
    pinned = mismatch_setup(
        _cfg(
            generator={"backend": "server", "url": "http://127.0.0.1:1/v1"},
            monitors={"sampler_mismatch": {"precision": "fp32", "max_abs_diff_fp32": 5e-4}},
        )
    )
    assert pinned is not None and (pinned.precision, pinned.threshold) == ("fp32", 5e-4)
    assert mismatch_setup(_cfg(monitors={"sampler_mismatch": {"enabled": False}})) is None


@pytest.mark.parametrize(
    ("launch_args", "precision"),
    [
        ([], "bf16"),  # vLLM's auto dtype: the checkpoint's, bf16 for an fp32 one
        (["--dtype", "bfloat16"], "bf16"),
        (["--dtype", "float32"], "fp32"),
        (["--max-model-len", "2048", "--dtype=float"], "fp32"),
        (["--dtype", "half"], "bf16"),  # fp16: the 16-bit threshold
    ],
)
def test_a_launched_vllm_is_judged_by_its_own_dtype(launch_args: list[str], precision: str) -> None:
    """Issue 35 (3): an fp32 vLLM judged by the bf16 threshold (0.1) hid a stale tied head after
    each sync (~3e-3 per token against ~1e-5 noise); its launch dtype now sets the threshold."""
    s = mismatch_setup(
        _cfg(generator={"backend": "server", "launch": "vllm", "launch_args": launch_args})
    )
    assert s is not None and s.precision == precision, s
    assert s.threshold == (1e-3 if precision == "fp32" else 0.1)


@pytest.mark.parametrize(
    ("generator", "objective", "tis_cap", "precision"),
    [
        ({"decode": "fast", "decode_dtype": "bfloat16"}, {}, 2.0, "bf16"),
        ({"decode": "fast", "decode_dtype": "float32"}, {}, None, "fp32"),
        ({"decode": "fast"}, {}, None, "fp32"),  # auto follows model.bf16: off
        ({"decode": "hf", "decode_dtype": "bfloat16"}, {}, None, "fp32"),  # no copy to sample from
        ({"decode_dtype": "bfloat16"}, {}, 2.0, "bf16"),  # decode auto takes the copy
        ({"decode": "fast", "decode_dtype": "bfloat16"}, {"tis_cap": 1.5}, 1.5, "bf16"),
        ({"decode": "fast", "decode_dtype": "bfloat16"}, {"tis_cap": None}, None, "bf16"),
    ],
)
def test_a_bf16_sampling_copy_turns_tis_on_and_the_bf16_threshold(
    generator: dict[str, Any], objective: dict[str, Any], tis_cap: float | None, precision: str
) -> None:
    """decode: fast from a bf16 copy of the weights samples in bf16 while the fp32 trainer scores:
    measured 0.01-0.057 per token on SmolLM2, so truncated IS is on unless the user set tis_cap
    (null opts out) and the monitor judges it against the bf16 threshold, not the fp32 one."""
    cfg = _cfg(generator=generator, objective=objective)
    assert cfg.objective.tis_cap == tis_cap
    s = mismatch_setup(cfg)
    assert s is not None and s.precision == precision
    if precision == "bf16":
        assert s.threshold == 0.1 and "bf16 copy" in s.why and "decode_dtype" in s.why


@pytest.mark.precision  # decode_dtype and model.bf16 left out resolve through `auto`
@pytest.mark.parametrize("auto_bf16", ["on", "off"])
def test_the_raw_config_rule_and_the_resolved_one_agree(
    auto_bf16: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TIS default reads the raw dict, the monitor the resolved config: both ask
    `bf16_sampling_copy`, with the fields' defaults where the raw dict leaves them out."""
    monkeypatch.setenv("RLVR_AUTO_BF16", auto_bf16)
    copies = 0
    for decode in (None, "hf", "fast"):
        for dtype in (None, "auto", "float32", "bfloat16"):
            for bf16 in (None, "auto", "on", "off"):
                gen = {k: v for k, v in (("decode", decode), ("decode_dtype", dtype)) if v}
                raw: dict[str, Any] = {"generator": gen, "model": {"bf16": bf16} if bf16 else {}}
                cfg = RunConfig.model_validate(raw)
                g = cfg.generator
                copy = bf16_sampling_copy(g.backend, g.decode, g.decode_dtype, cfg.model.bf16)
                assert (cfg.objective.tis_cap == 2.0) == copy, raw
                s = mismatch_setup(cfg)
                assert s is not None and (s.precision == "bf16") >= copy, raw
                copies += copy
    # decode fast or auto (left out), each: bfloat16 under any of the 4 model.bf16 settings, or
    # dtype auto / left out where the sampler's bf16 resolves on (model.bf16 on; auto with the env)
    assert copies == 2 * (4 + (2 * 3 if auto_bf16 == "on" else 2))


def test_the_behaviour_gap_is_not_read_where_it_is_stale_or_renormalised_by_design() -> None:
    stale = mismatch_setup(_cfg(rollout={"async_rollouts": True}))
    assert stale is not None and stale.keys == (CANARY_METRIC,) and "async" in stale.not_read
    nucleus = mismatch_setup(
        _cfg(
            generator={"backend": "server", "url": "http://127.0.0.1:1/v1"},
            sampling={"top_p": 0.9},
        )
    )
    assert nucleus is not None and nucleus.keys == (CANARY_METRIC,)


def test_the_rule_fires_just_past_the_threshold_and_not_at_it() -> None:
    s = MismatchSetup("fp32", 1e-3, "both fp32", (CANARY_METRIC, BEHAVIOUR_METRIC))
    assert sampler_mismatch([{"step": 1.0, BEHAVIOUR_METRIC: 1e-3, CANARY_METRIC: 2e-6}], s) is None
    found = sampler_mismatch([{"step": 1.0, BEHAVIOUR_METRIC: 1.1e-3}], s)
    assert found is not None and BEHAVIOUR_METRIC in found.message
    assert found.evidence == {BEHAVIOUR_METRIC: 1.1e-3, "threshold": 1e-3}
    found = sampler_mismatch([{"step": 2.0, CANARY_METRIC: 0.5, BEHAVIOUR_METRIC: 0.2}], s)
    assert found is not None and "canary" in found.message  # the canary is named first


def test_monitors_run_the_rule_once_per_episode() -> None:
    cfg = _cfg()
    from rlvr.observe.mismatch import mismatch_rule

    monitors = Monitors(cfg.monitors, extra=[mismatch_rule(cfg)])
    fired = [
        [a.name for a in monitors.observe(step, {BEHAVIOUR_METRIC: gap})]
        for step, gap in enumerate([1e-6, 0.2, 0.3, 1e-6, 0.2], start=1)
    ]
    assert fired == [[], ["sampler_mismatch"], [], [], ["sampler_mismatch"]]


# ------------------------------------------------------------------------------------- end to end
def _events(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == "sampler_mismatch"]


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _server_run(
    tiny_config_dir: Path, tiny_model_dir: Path, run_dir: Path, *more: str
) -> tuple[Any, list[dict[str, Any]]]:
    """Train the tiny model on `rlvr serve`'s in-process app (its own copy of the model) by URL.
    rlvr serve samples in fp32, which a server given by URL is not assumed to: say so."""
    server_policy = load_policy(str(tiny_model_dir))
    with BackgroundServer(
        create_app(serve_state(server_policy, str(tiny_model_dir)), open_admin=True)
    ) as srv:
        cfg = load_config(
            tiny_config_dir / "tiny.yaml",
            [
                f"model.name={tiny_model_dir}", f"output_dir={run_dir}", "model.bf16='off'",
                "tracking.progress=false", "eval.at_start=false", "eval.at_end=false",
                "generator.backend=server", f"generator.url={srv.base_url}",
                "monitors.sampler_mismatch.precision=fp32", *more,
            ],
        )  # fmt: skip
        summary = train(cfg, config_dir=tiny_config_dir)
    return summary, _steps(run_dir)


def test_a_weight_sync_that_silently_does_nothing_trips_the_canary(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server answers the reload with success but keeps its weights. After the first update the
    canary, scored by the server and by the trainer, disagrees: the monitor stops the run there,
    before any step trains on the stale samples. With the sync working, nothing fires."""
    good, rows = _server_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "synced", "train.steps=2",
        "generator.weight_sync=full",
    )  # fmt: skip
    assert good.stopped_early is None and not _events(tmp_path / "synced")
    assert len(rows) == 2 and all(r[CANARY_METRIC] < 1e-4 for r in rows), rows

    monkeypatch.setattr(completions, "reload_weights", lambda state, path: None)
    bad, rows = _server_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "broken", "train.steps=3",
        "generator.weight_sync=full", "monitors.sampler_mismatch.action=stop",
    )  # fmt: skip
    assert bad.steps_done == 1 and bad.stopped_early is not None
    assert bad.stopped_early.startswith("sampler_mismatch: ")
    assert (
        rows[0][CANARY_METRIC] > 1e-3 and rows[0][BEHAVIOUR_METRIC] < 1e-4
    )  # caught by the canary
    (event,) = _events(tmp_path / "broken")
    assert event["step"] == 1 and event["action"] == "stop"
    assert CANARY_METRIC in event["message"] and event["evidence"][CANARY_METRIC] > 1e-3


def test_a_sampler_that_is_never_synced_trips_the_behaviour_gap(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """weight_sync none: no sync, so no canary; the step after the first update samples from the old
    weights and its behaviour gap fires the (warn) alert, while the run goes on."""
    summary, rows = _server_run(
        tiny_config_dir, tiny_model_dir, tmp_path / "never", "train.steps=3",
        "generator.weight_sync=none",
    )  # fmt: skip
    assert summary.steps_done == 3 and summary.stopped_early is None
    assert all(CANARY_METRIC not in r for r in rows)
    (event,) = _events(tmp_path / "never")
    assert event["step"] == 2 and event["action"] == "warn"
    assert BEHAVIOUR_METRIC in event["message"]
    assert rows[1]["alerts/sampler_mismatch"] == 1.0
