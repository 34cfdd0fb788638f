"""benchmarks/vs_trl.py's reporting without TRL or a model: CPU detection from /proc/cpuinfo text,
which runs one invocation makes on each CPU kind, which TRL precision the ratios use, the ratio
arithmetic, the table, and the script's wiring with its workers replaced by canned results."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# First processor's lines of /proc/cpuinfo, trimmed: the two CPU kinds docs/performance.md splits by.
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni
"""
ROME = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx avx2 fma
"""
SAPPHIRE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
LSCPU = "Architecture:  x86_64\nCPU(s):  2\nModel name:  AMD EPYC\nFlags:  fpu avx2\n"


def _load(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # vs_trl.py imports its helpers as a script would
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def machine() -> ModuleType:
    return _load("_machine")


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return _load("_vs_trl_report")


def test_native_bf16_is_read_from_the_flags_line(machine: ModuleType) -> None:
    assert machine.native_bf16_flags(ZEN4) == ("avx512_bf16",)
    assert machine.native_bf16_flags(SAPPHIRE) == ("avx512_bf16", "amx_bf16")
    assert machine.native_bf16_flags(ROME) == ()
    # Whole flags only, and only on the flags line (not in the model name, not a longer flag).
    fake = "model name\t: avx512_bf16 edition\nflags\t\t: avx2 avx512_bf16x\n"
    assert machine.native_bf16_flags(fake) == ()
    assert machine.native_bf16_flags("") == ()
    assert machine.cpu_kind((), machine.cpu_flags(ROME)).startswith("AVX2-only")
    assert machine.cpu_kind(("avx512_bf16",), machine.cpu_flags(ZEN4)) == (
        "native bf16 (avx512_bf16)"
    )


def test_model_name_prefers_lscpu_then_cpuinfo(machine: ModuleType) -> None:
    assert machine.cpu_model_name(LSCPU, ZEN4) == "AMD EPYC"
    assert machine.cpu_model_name("", ZEN4) == "AMD EPYC 9R14 96-Core Processor"
    assert machine.cpu_model_name("", "") == "unknown CPU"


def test_header_states_cpu_threads_commit_and_date(machine: ModuleType) -> None:
    m = machine.Machine(
        cpu="AMD EPYC", kind="native bf16 (avx512_bf16)", cpus=2, torch_version="2.13.0",
        torch_threads=2, omp_num_threads=None, commit="abc1234", commit_date="2026-12-01",
        dirty=True, run_date="2026-12-02 10:00 UTC",
    )  # fmt: skip
    text = "\n".join(m.header())
    for part in ("AMD EPYC", "avx512_bf16", "2 threads", "OMP unset", "abc1234", "2026-12-01",
                 "uncommitted", "2026-12-02 10:00 UTC"):  # fmt: skip
        assert part in text


def test_which_runs_each_cpu_kind_makes(report: ModuleType) -> None:
    assert report.trl_variants("auto", native_bf16=True) == ["fp32", "bf16"]
    assert report.trl_variants("auto", native_bf16=False) == ["fp32"]  # ~8x slower there
    assert report.trl_variants("on", native_bf16=False) == ["fp32", "bf16"]
    assert report.trl_variants("off", native_bf16=True) == ["fp32"]
    with pytest.raises(ValueError):
        report.trl_variants("yes", native_bf16=True)
    assert report.fast_variant("auto", native_bf16=True) == "fast-bfloat16"
    assert report.fast_variant("auto", native_bf16=False) == "fast-float32"
    assert report.fast_variant("bfloat16", native_bf16=False) == "fast-bfloat16"
    assert report.fast_variant("off", native_bf16=True) is None
    assert report.rlvr_overrides("default") == []
    assert report.rlvr_overrides("fast-bfloat16") == [
        "generator.decode=fast",
        "generator.decode_dtype=bfloat16",
    ]
    # TRL and rlvr alternate within a mode; a missing row leaves the other side's order alone.
    assert report.worker_specs(["full", "lora"], ["fp32", "bf16"], "fast-bfloat16") == [
        "trl:full:fp32", "rlvr:full:default", "trl:full:bf16", "rlvr:full:fast-bfloat16",
        "trl:lora:fp32", "rlvr:lora:default", "trl:lora:bf16", "rlvr:lora:fast-bfloat16",
    ]  # fmt: skip
    assert report.worker_specs(["full"], ["fp32"], "fast-float32") == [
        "trl:full:fp32", "rlvr:full:default", "rlvr:full:fast-float32",
    ]  # fmt: skip
    assert report.worker_specs(["full"], ["fp32"], None) == ["trl:full:fp32", "rlvr:full:default"]
    assert report.parse_spec("trl:lora:bf16") == ("trl", "lora", "bf16")
    assert report.parse_spec("trl:full") == ("trl", "full", "fp32")
    assert report.parse_spec("rlvr:full") == ("rlvr", "full", "default")
    assert report.parse_spec("base:learn") == ("base", "learn", "")


def _run(s: float, rss: float, precision: str = "", **extra: Any) -> dict[str, Any]:
    return {"s_per_step": s, "tokens_per_s": 30.0, "peak_rss_mb": rss, "precision": precision,
            **extra}  # fmt: skip


def _rlvr(s: float, rss: float) -> dict[str, Any]:
    return _run(s, rss, "fp32", rollout_s=s / 2, update_s=s / 2, update_gflops_per_s=80.0)


# Issue 18's Xeon shape: TRL bf16 faster than TRL fp32.
XEON = {
    ("trl", "full", "fp32"): _run(26.2, 5000.0, "fp32", trl_version="1.16.0"),
    ("rlvr", "full", "default"): _rlvr(18.6, 4500.0),
    ("trl", "full", "bf16"): _run(23.4, 5200.0, "bf16 autocast", trl_version="1.16.0"),
    ("rlvr", "full", "fast-bfloat16"): _rlvr(11.7, 4680.0),
}


def test_ratios_use_the_faster_trl_precision(report: ModuleType) -> None:
    assert report.faster_trl(XEON, "full") == "bf16"
    fields = report.ratio_fields(XEON, "full")
    assert fields["trl_reference"] == "bf16"
    assert fields["step_time_ratio_trl_over_rlvr"] == pytest.approx(23.4 / 18.6)
    assert fields["step_time_ratio_trl_over_rlvr_fast"] == pytest.approx(2.0)
    assert fields["peak_rss_ratio_rlvr_over_trl"] == pytest.approx(4500 / 5200)
    assert fields["peak_rss_ratio_rlvr_fast_over_trl"] == pytest.approx(0.9)
    assert report.format_fields(fields) == (
        "trl_reference=bf16 step_time_ratio_trl_over_rlvr=1.26 peak_rss_ratio_rlvr_over_trl=0.87 "
        "step_time_ratio_trl_over_rlvr_fast=2.00 peak_rss_ratio_rlvr_fast_over_trl=0.90"
    )
    # On an AVX2 host bf16 is the slow one: fp32 becomes the reference.
    avx2 = dict(XEON)
    avx2[("trl", "full", "bf16")] = _run(210.0, 5200.0)
    assert report.faster_trl(avx2, "full") == "fp32"
    assert report.ratio_fields(avx2, "full")["step_time_ratio_trl_over_rlvr"] == pytest.approx(
        26.2 / 18.6
    )
    # A tie keeps fp32; no TRL run, no ratio.
    tie = {("trl", "full", "bf16"): _run(20.0, 1.0), ("trl", "full", "fp32"): _run(20.0, 1.0)}
    assert report.faster_trl(tie, "full") == "fp32"
    assert report.faster_trl({("rlvr", "full", "default"): _rlvr(1.0, 1.0)}, "full") is None
    assert report.ratio_fields({("rlvr", "full", "default"): _rlvr(1.0, 1.0)}, "full") == {}


def test_table_marks_the_reference_and_compares_every_row_with_it(report: ModuleType) -> None:
    lines = report.render_table(XEON, ["full"])
    assert lines[0].startswith("| mode | run | precision | s/step")
    rows = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in lines[2:]}
    assert [line.split(" | ")[1][:4] for line in lines[2:]] == ["TRL ", "TRL ", "rlvr", "rlvr"]
    assert set(rows) == {
        "TRL 1.16.0 GRPOTrainer, bf16=False",
        "TRL 1.16.0 GRPOTrainer, bf16=True",
        "rlvr, defaults",
        "rlvr, decode=fast, bf16 sampling copy",
    }
    assert rows["TRL 1.16.0 GRPOTrainer, bf16=True"][-2:] == ["ref", "ref"]
    assert rows["TRL 1.16.0 GRPOTrainer, bf16=False"][-2:] == ["0.89x", "0.96"]
    assert rows["rlvr, defaults"][-2:] == ["1.26x", "0.87"]
    assert rows["rlvr, defaults"][3:7] == ["18.60", "9.3", "9.3", "80"]
    assert rows["rlvr, decode=fast, bf16 sampling copy"][-2:] == ["2.00x", "0.90"]


def test_reference_line_says_which_trl_run_and_why(report: ModuleType) -> None:
    line = report.reference_line(XEON, "full", None)
    assert "against TRL bf16=True, 23.40 s/step" in line
    assert "bf16=False 26.20 s" in line and "bf16=True 23.40 s" in line
    only_fp32 = {k: v for k, v in XEON.items() if k[2] != "bf16"}
    skipped = report.bf16_skip_reason(["fp32"], "auto", only_fp32, "full")
    assert "avx512_bf16" in skipped and "--trl-bf16 on" in skipped
    line = report.reference_line(only_fp32, "full", skipped)
    assert "against TRL bf16=False, 26.20 s/step: the only TRL precision run" in line
    assert "--trl-bf16 off" in report.bf16_skip_reason(["fp32"], "off", only_fp32, "full")
    # Asked for and missing: it failed, and the line says so instead of implying it was skipped.
    assert "FAILED" in report.bf16_skip_reason(["fp32", "bf16"], "auto", only_fp32, "full")
    assert report.bf16_skip_reason(["fp32", "bf16"], "auto", XEON, "full") is None
    assert report.reference_line({}, "lora", None) == "lora: no TRL run finished; no ratio"


def _canned(spec: str, _passthrough: list[str]) -> dict[str, Any]:
    framework, _mode, variant = spec.split(":")
    s = {("trl", "fp32"): 30.0, ("trl", "bf16"): 24.0, ("rlvr", "default"): 20.0}.get(
        (framework, variant), 12.0
    )
    if framework == "trl":
        return _run(s, 5000.0, variant, trl_version="1.16.0")
    return _rlvr(s, 4000.0)


@pytest.mark.parametrize("native", [True, False])
def test_the_script_runs_the_cpu_kinds_rows_and_quotes_the_faster_trl(
    report: ModuleType, machine: ModuleType, native: bool, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    vs_trl = _load("vs_trl")
    ran: list[str] = []

    def fake_subprocess(spec: str, passthrough: list[str]) -> dict[str, Any]:
        ran.append(spec)
        return _canned(spec, passthrough)

    fixed = machine.Machine("Test CPU", "kind", 2, "2.13.0", 2, "2", "abc1234", "2026-12-01",
                            False, "2026-12-02 10:00 UTC")  # fmt: skip
    monkeypatch.setattr(vs_trl, "_subprocess", fake_subprocess)
    monkeypatch.setattr(vs_trl, "matmul_peak_gflops", lambda: 100.0)
    monkeypatch.setattr(vs_trl, "machine", lambda: fixed)
    monkeypatch.setattr(vs_trl, "has_native_bf16", lambda: native)
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--modes", "full"])
    vs_trl.main()
    out = capsys.readouterr().out.splitlines()
    if native:
        assert ran == [
            "trl:full:fp32",
            "rlvr:full:default",
            "trl:full:bf16",
            "rlvr:full:fast-bfloat16",
        ]
        assert out[-1] == (
            "trl_reference=bf16 step_time_ratio_trl_over_rlvr=1.20 peak_rss_ratio_rlvr_over_trl=0.80 "
            "step_time_ratio_trl_over_rlvr_fast=2.00 peak_rss_ratio_rlvr_fast_over_trl=0.80"
        )
    else:
        assert ran == ["trl:full:fp32", "rlvr:full:default", "rlvr:full:fast-float32"]
        assert out[-1].startswith("trl_reference=fp32 step_time_ratio_trl_over_rlvr=1.50 ")
        assert any("no avx512_bf16 / amx_bf16" in line for line in out)
    assert out[0] == "CPU: Test CPU, 2 CPUs, kind"
    assert sum(line == "CPU: Test CPU, 2 CPUs, kind" for line in out) == 2  # start and table
    assert any(line.startswith("| full | rlvr, defaults |") for line in out)


def test_help_names_the_precision_options() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "vs_trl.py"), "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert "--trl-bf16 {auto,on,off}" in out and "--rlvr-fast" in out
