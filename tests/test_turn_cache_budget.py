"""The turn cache's memory cap (`generator.turn_cache_mb`): `auto` from the memory free when a
session opens, a number as given, and a warning, once per session, when rows past the cap make
conversations re-prefill (they used to do so silently). Helpers from tests/test_turn_cache.py."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.config import config_to_dict, load_config
from rlvr.errors import ConfigError
from rlvr.models import load_policy
from rlvr.rollout import turn_cache
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.hf import HFGenerator
from test_turn_cache import assert_same, make_gen, openings, play

GIB = 2**30
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    policy = load_policy(str(tiny_model_dir))
    policy.model.eval()
    return policy.model, policy.tokenizer


def fake_meminfo(monkeypatch: pytest.MonkeyPatch, available: int | None) -> None:
    monkeypatch.setattr(turn_cache, "meminfo_available_bytes", lambda: available)


@pytest.mark.parametrize(
    ("available", "expected_mb"),
    [(10 * GIB, 2048.0), (20 * GIB, 4096.0), (1 * GIB, 1024.0), (8 * GIB, 1638.4), (None, 1024.0)],
)
def test_auto_is_a_share_of_the_free_memory_never_below_the_floor(
    monkeypatch: pytest.MonkeyPatch, available: int | None, expected_mb: float
) -> None:
    fake_meminfo(monkeypatch, available)
    assert turn_cache.resolve_cap_mb("auto", CPU) == pytest.approx(expected_mb)
    assert turn_cache.resolve_cap_mb(3, CPU) == 3.0  # a number is the cap as given
    assert turn_cache.resolve_cap_mb(0.5, CPU) == 0.5


def test_auto_on_cuda_reads_the_device_not_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Faked (no GPU needed): free device memory plus what torch's allocator holds unused."""
    fake_meminfo(monkeypatch, 100 * GIB)  # must not be read for a CUDA model
    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 8 * GIB, 141 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 * GIB)
    gpu = torch.device("cuda", 1)
    assert turn_cache.resolve_cap_mb("auto", gpu) == pytest.approx(0.2 * 10 * 1024)
    assert asked == [gpu]


def test_sizes_in_the_warning() -> None:
    assert turn_cache.size_text(5.5 * GIB) == "5632 MiB"
    assert turn_cache.size_text(2.5 * 2**20) == "2.5 MiB"
    assert turn_cache.size_text(3 * 2**10) == "3 KiB"


def test_meminfo_is_read_on_linux() -> None:
    if not Path("/proc/meminfo").is_file():
        pytest.skip("no /proc/meminfo here")
    available = turn_cache.meminfo_available_bytes()
    assert available is not None and available > 0


def test_a_session_resolves_auto_when_it_opens(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = tiny
    generator = make_gen(model, tok, True)
    assert generator.turn_cache_mb == "auto"  # the default
    for available, mb in ((20 * GIB, 4096), (1 * GIB, 1024)):
        fake_meminfo(monkeypatch, available)
        with generator.turn_session() as store:
            assert store is not None and store.max_bytes == mb * 2**20
    with make_gen(model, tok, True, turn_cache_mb=3).turn_session() as store:
        assert store is not None and store.max_bytes == 3 * 2**20


def test_config_takes_auto_or_a_number(tmp_path: Path) -> None:
    assert load_config(None).generator.turn_cache_mb == "auto"  # the default
    for raw, value in (("auto", "auto"), ("AUTO", "auto"), ("2048", 2048.0), ("0.5", 0.5)):
        cfg = load_config(None, [f"generator.turn_cache_mb={raw}"])
        assert cfg.generator.turn_cache_mb == value
    for text, value in (("auto", "auto"), ("2048", 2048.0), ("'512'", 512.0)):
        path = tmp_path / "run.yaml"
        path.write_text(f"generator:\n  turn_cache_mb: {text}\n")
        cfg = load_config(path)
        assert cfg.generator.turn_cache_mb == value
        again = tmp_path / "again.yaml"  # written and read back as a run directory does
        again.write_text(
            f"generator:\n  turn_cache_mb: {config_to_dict(cfg)['generator']['turn_cache_mb']}\n"
        )
        assert load_config(again).generator.turn_cache_mb == value


@pytest.mark.parametrize("raw", ["-1", "lots", "off", "true", "nan", "inf", "[1]", "null"])
def test_config_refuses_other_caps_in_one_line(raw: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"generator.turn_cache_mb={raw}"])
    message = str(err.value)
    assert "'generator.turn_cache_mb': expected auto or a number of MiB >= 0" in message
    assert "\n" not in message


def cap_warnings(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in caught if "generator.turn_cache" in str(w.message)]


def row_bytes(generator: HFGenerator, tok: Any) -> int:
    with generator.turn_session() as store:
        assert store is not None
        generator.generate(openings(tok)[:1], SamplingParams(n=1, max_new_tokens=6))
        return next(iter(store.entries.values())).nbytes


def test_rows_past_a_tiny_cap_warn_once_with_the_counts(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    plain, _ = play(make_gen(model, tok, False), tok, openings(tok), 4, sampling)
    cap_mb = 2.5 * row_bytes(make_gen(model, tok, True), tok) / 2**20  # about two rows of six
    small = make_gen(model, tok, True, turn_cache_mb=cap_mb)
    (cached, stats), said = cap_warnings(lambda: play(small, tok, openings(tok), 4, sampling))
    assert_same(plain, cached)  # the cap only costs time
    # Turns 2-4 each re-prefilled the rows the cap dropped; one warning, with turn 2's numbers.
    refilled = stats[1]["misses"] - stats[0]["misses"]
    assert stats[1]["past_cap"] == refilled >= 3 and stats[-1]["past_cap"] > refilled
    assert len(said) == 1
    kept = 6 - stats[0]["not_kept"]
    assert said[0].startswith(f"generator.turn_cache: {refilled} of 6 conversations re-prefill")
    cap = turn_cache.size_text(int(cap_mb * 2**20))
    assert f"cap of {cap} kept {kept} of the last turn's 6 rows" in said[0]
    assert "KiB more would have kept them all" in said[0] and "generator.turn_cache_mb" in said[0]
    assert small.turn_stats == stats[-1]  # the last session's counts, for whoever logs them
    # A new session warns again (once).
    _, said_again = cap_warnings(lambda: play(small, tok, openings(tok), 3, sampling))
    assert len(said_again) == 1


def test_auto_names_itself_in_the_warning(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = tiny
    one_row = row_bytes(make_gen(model, tok, True, turn_cache_mb=1), tok)
    monkeypatch.setattr(turn_cache, "auto_cap_mb", lambda device: 1.5 * one_row / 2**20)
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    _, said = cap_warnings(
        lambda: play(make_gen(model, tok, True), tok, openings(tok), 2, sampling)
    )
    assert len(said) == 1 and "(auto: 20% of the memory free when the rollout began)" in said[0]


def test_no_warning_when_every_row_fits(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    plain, _ = play(make_gen(model, tok, False), tok, openings(tok), 3, sampling)
    (cached, stats), said = cap_warnings(
        lambda: play(make_gen(model, tok, True), tok, openings(tok), 3, sampling)
    )
    assert_same(plain, cached)
    assert said == [] and stats[-1]["not_kept"] == 0 and stats[-1]["past_cap"] == 0


def test_rows_dropped_on_the_last_turn_cost_nothing_and_say_nothing(
    tiny: tuple[Any, Any],
) -> None:
    """The warning counts conversations that did re-prefill, not rows that ended anyway."""
    model, tok = tiny
    generator = make_gen(model, tok, True, turn_cache_mb=0)
    (_, stats), said = cap_warnings(
        lambda: play(generator, tok, openings(tok), 1, SamplingParams(n=2, max_new_tokens=4))
    )
    assert stats[-1]["not_kept"] == 6 and said == []
