"""benchmarks/vs_trl.py's pure parts: which runs one invocation makes (TRL in fp32 and, where it
pays, bf16; rlvr at its defaults and with its own decode path), which TRL run the ratios use (the
faster one), and the side-by-side table. No model, no TRL: tests/test_vs_trl_report.py runs them.

A result is the dict a worker prints (`s_per_step`, `peak_rss_mb`, `precision`; rlvr adds
`rollout_s`, `update_s`, `update_gflops_per_s`), keyed by (framework, mode, variant):
framework "trl" | "rlvr", mode "full" | "lora", variant "fp32" | "bf16" for TRL and "default" |
"fast-float32" | "fast-bfloat16" for rlvr.
"""

from __future__ import annotations

import itertools
from typing import Any

Key = tuple[str, str, str]
Results = dict[Key, dict[str, Any]]

TRL_BF16_CHOICES = ("auto", "on", "off")
RLVR_FAST_CHOICES = ("auto", "bfloat16", "float32", "off")


def trl_variants(setting: str, native_bf16: bool) -> list[str]:
    """TRL's precisions to run: fp32 always; bf16 (`bf16=True`, TRL's own default) when `setting` is
    on, or auto on a CPU with native bf16 (on an AVX2-only CPU it is ~8x slower: run it when asked)."""
    if setting not in TRL_BF16_CHOICES:
        raise ValueError(f"--trl-bf16 {setting!r}: expected one of {', '.join(TRL_BF16_CHOICES)}")
    bf16 = setting == "on" or (setting == "auto" and native_bf16)
    return ["fp32", "bf16"] if bf16 else ["fp32"]


def fast_variant(setting: str, native_bf16: bool) -> str | None:
    """rlvr's second row: its own decode path (`generator.decode: fast`) with a bf16 weight copy for
    sampling on a CPU with native bf16 (auto), else a float32 copy; None when off."""
    if setting not in RLVR_FAST_CHOICES:
        raise ValueError(f"--rlvr-fast {setting!r}: expected one of {', '.join(RLVR_FAST_CHOICES)}")
    if setting == "off":
        return None
    if setting == "auto":
        setting = "bfloat16" if native_bf16 else "float32"
    return f"fast-{setting}"


def rlvr_overrides(variant: str) -> list[str]:
    """The `--set` overrides an rlvr variant adds after the user's `--rlvr-set` ones."""
    if variant == "default":
        return []
    if variant.startswith("fast-"):
        return ["generator.decode=fast", f"generator.decode_dtype={variant.removeprefix('fast-')}"]
    raise ValueError(f"unknown rlvr variant {variant!r}")


def worker_specs(modes: list[str], trl: list[str], fast: str | None) -> list[str]:
    """Worker specs in run order: per mode TRL and rlvr alternate (trl fp32, rlvr default, trl bf16,
    rlvr fast), so both frameworks see the machine's load drift alike."""
    rlvr = ["default", *([fast] if fast else [])]
    specs = []
    for mode in modes:
        for t, r in itertools.zip_longest(trl, rlvr):
            specs += [f"trl:{mode}:{t}"] * (t is not None) + [f"rlvr:{mode}:{r}"] * (r is not None)
    return specs


def parse_spec(spec: str) -> Key:
    """ "framework:mode[:variant]" -> (framework, mode, variant); the variant defaults to TRL's fp32
    and rlvr's defaults (and is "" for the learning workers)."""
    framework, mode, *rest = spec.split(":")
    if rest:
        return framework, mode, rest[0]
    if mode == "learn":
        return framework, mode, ""
    return framework, mode, "fp32" if framework == "trl" else "default"


def faster_trl(results: Results, mode: str) -> str | None:
    """The TRL variant with the lower step time in `mode` (fp32 on a tie); None if TRL never ran."""
    runs = [(r["s_per_step"], k[2]) for k, r in results.items() if k[:2] == ("trl", mode)]
    runs.sort(key=lambda sv: (sv[0], sv[1] != "fp32"))
    return runs[0][1] if runs else None


def run_label(framework: str, variant: str, result: dict[str, Any]) -> str:
    if framework == "trl":
        version = result.get("trl_version", "")
        return f"TRL {version} GRPOTrainer, bf16={variant == 'bf16'}".replace("  ", " ")
    if variant == "default":
        return "rlvr, defaults"
    dtype = variant.removeprefix("fast-")
    copy = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
    return f"rlvr, decode=fast, {copy} sampling copy"


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def render_table(results: Results, modes: list[str]) -> list[str]:
    """A Markdown table, one row per run (TRL's first, each side in run order); the last two
    columns compare each run with the faster TRL run of its mode (marked "ref"): step-time ratio
    TRL / run (above 1: the run is faster) and peak RSS run / TRL (below 1: the run is smaller)."""
    lines = [
        "| mode | run | precision | s/step | rollout s | update s | update GFLOP/s | peak RSS MB "
        "| TRL's faster / this | RSS this / TRL's faster |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        ref_variant = faster_trl(results, mode)
        ref = results.get(("trl", mode, ref_variant or ""))
        runs = sorted(results.items(), key=lambda kr: kr[0][0] != "trl")  # TRL's rows first
        for (framework, m, variant), r in runs:
            if m != mode:
                continue
            if ref is None:
                speed = rss = ""
            elif framework == "trl" and variant == ref_variant:
                speed = rss = "ref"
            else:
                speed = f"{ref['s_per_step'] / r['s_per_step']:.2f}x"
                rss = f"{r['peak_rss_mb'] / ref['peak_rss_mb']:.2f}"
            label = run_label(framework, variant, r)
            lines.append(
                f"| {mode} | {label} | {r.get('precision', '')} | {r['s_per_step']:.2f} "
                f"| {_fmt(r.get('rollout_s'), '.1f')} | {_fmt(r.get('update_s'), '.1f')} "
                f"| {_fmt(r.get('update_gflops_per_s'), '.0f')} | {r['peak_rss_mb']:.0f} "
                f"| {speed} | {rss} |"
            )
    return lines


def ratio_fields(results: Results, mode: str) -> dict[str, Any]:
    """The quoted ratios of one mode, all against the faster TRL run: step_time_ratio_trl_over_rlvr
    (rlvr defaults), ..._rlvr_fast (rlvr's own decode row), peak_rss_ratio_rlvr_over_trl (+ _fast)."""
    ref_variant = faster_trl(results, mode)
    if ref_variant is None:
        return {}
    ref = results[("trl", mode, ref_variant)]
    fields: dict[str, Any] = {"trl_reference": ref_variant}
    for (framework, m, variant), r in results.items():
        if framework != "rlvr" or m != mode:
            continue
        suffix = "" if variant == "default" else "_fast"
        fields[f"step_time_ratio_trl_over_rlvr{suffix}"] = ref["s_per_step"] / r["s_per_step"]
        fields[f"peak_rss_ratio_rlvr{suffix}_over_trl"] = r["peak_rss_mb"] / ref["peak_rss_mb"]
    return fields


def format_fields(fields: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
    )


def reference_line(results: Results, mode: str, trl_skipped: str | None) -> str:
    """Says which TRL run the mode's ratios use and why (both step times, or why bf16 did not run)."""
    ref_variant = faster_trl(results, mode)
    if ref_variant is None:
        return f"{mode}: no TRL run finished; no ratio"
    ran = {k[2]: r for k, r in results.items() if k[:2] == ("trl", mode)}
    ref = ran[ref_variant]
    label = f"bf16={ref_variant == 'bf16'}"
    if len(ran) > 1:
        times = ", ".join(f"bf16={v == 'bf16'} {r['s_per_step']:.2f} s" for v, r in ran.items())
        why = f"the faster of {times}"
    else:
        why = "the only TRL precision run" + (f" ({trl_skipped})" if trl_skipped else "")
    return f"{mode}: ratios against TRL {label}, {ref['s_per_step']:.2f} s/step: {why}"


def bf16_skip_reason(trl: list[str], setting: str, results: Results, mode: str) -> str | None:
    """Why TRL's bf16 run of `mode` is missing, for the reference line (None when it ran)."""
    if ("trl", mode, "bf16") in results:
        return None
    if "bf16" in trl:
        return "bf16=True FAILED: see its error above"
    if setting == "off":
        return "bf16=True not run: --trl-bf16 off"
    return (
        "bf16=True not run: this CPU has no avx512_bf16 / amx_bf16, where bf16 is ~8x slower; "
        "--trl-bf16 on runs it"
    )
