"""The `batchgen bench` report as a table: throughputs, roofline fraction, where the time went,
start-up phases, and the comparisons (host tier, prefix caching)."""

from __future__ import annotations

from batchgen.phases import format_phases


def format_table(report: dict) -> str:
    w = report["weights"]
    host = (f", {w['host_bytes'] / 2**30:.1f} GiB of experts in host memory"
            if w["host_bytes"] else "")
    header = (f"{report['config']['shape']} ({report['dtype']}): {_count(w['params'])} params "
              f"({_count(w['active_params'])} active per token), "
              f"{w['device_bytes'] / 2**30:.1f} GiB of weights on {report['device']}{host}")
    lines = [header,
             f"{'runner':<14}{'output tok/s':>14}{'total tok/s':>14}{'seconds':>10}"
             f"{'roofline':>10}"]
    for name, row in report["results"].items():
        if not isinstance(row, dict):
            continue  # the HF ratio, printed below
        frac = row.get("roofline_fraction")
        lines.append(f"{name:<14}{row['output_tok_s']:>14,.1f}{row['total_tok_s']:>14,.1f}"
                     f"{row['seconds']:>10.2f}{'' if frac is None else f'{frac:>9.0%}':>10}")
    if "ratio" in report["results"]:
        lines.append(f"batchgen / hf_generate output tok/s: {report['results']['ratio']:.2f}x")
    times = report["engine_stats"].get("times")
    if times:
        lines.append(
            f"batchgen time: schedule {times['schedule_s']:.2f} s, decode forwards "
            f"{times['forward_decode_s']:.2f} s ({times['decode_steps']:,} steps, "
            f"{times['bursts']:,} bursts), other forwards {times['forward_other_s']:.2f} s, "
            f"postprocess {times['postprocess_s']:.2f} s; untimed warm-up "
            f"{report['warmup_seconds']:.1f} s")
    startup = report.get("startup")
    if startup:
        lines.append(f"whole command to the end of the timed run: {startup['whole_seconds']:.1f} s "
                     f"({startup['whole_over_timed']:.2f}x the timed run): "
                     + format_phases(startup["phases"]))
    variants = report["engine_stats"].get("triton_variants_in_timed_run")
    if variants:
        lines.append(f"note: {variants} Triton kernel variants were first launched inside the "
                     "timed run (JIT compiles on a fresh machine: a rerun reads them from "
                     "Triton's cache): " + "; ".join(
                         name.split("(")[0] for name in
                         report["engine_stats"].get("triton_variants_first_launched",
                                                    "").split(" | ")))
    copies = report["engine_stats"].get("expert_copies")
    if copies:
        lines.append(f"offloaded experts copied in (warm-up included): {copies['experts']:,} in "
                     f"{copies['fetches']:,} fetches, {copies['bytes'] / 1e9:,.1f} GB")
    if "host_tier" in report:
        lines += _host_tier_lines(report["host_tier"], report["device"])
    if "prefix_caching" in report:
        from batchgen.bench_prefix import table_lines

        lines += table_lines(report["prefix_caching"], report["device"])
    return "\n".join(lines)


def _host_tier_lines(tier: dict, device: str) -> list[str]:
    """The comparison's verdict and the scheduler counters that explain it. Different tokens
    mean a scheduler bug only on CPU in float32 (tests/test_bench_host_tier.py checks that):
    on CUDA the two runs batch differently, bf16 GEMMs then round in a different order, and
    near-tied logits of random weights flip."""
    if tier["same_tokens"]:
        same = "same tokens"
    elif "cuda" in device:
        same = "tokens differ (expected on CUDA: batch-dependent bf16 rounding)"
    else:
        same = "TOKENS DIFFER (a scheduler bug)"
    columns = (f"{'host tier':<10}{'pages dev/host':>18}{'peak host':>11}{'loads':>8}"
               f"{'unloads':>9}{'evictions':>11}{'recomputed':>12}{'steps':>9}")
    lines = [f"host tier on (batchgen) / off output tok/s: {tier['ratio']:.2f}x, {same}", columns]
    for name in ("on", "off"):
        s = tier[name]
        lines.append(f"{name:<10}{s['device_pages']:>10,}/{s['host_pages']:<7,}"
                     f"{s['peak_host_pages']:>11,}{s['loads']:>8,}{s['unloads']:>9,}"
                     f"{s['evictions']:>11,}{s['reprefill_tokens']:>12,}{s['steps']:>9,}")
    if tier["on"]["host_pages"] <= tier["on"]["device_pages"]:
        lines.append("note: the host pool is not larger than the device pool, so 'on' has no "
                     "more host room than 'off'; raise --host-kv-cache-size")
    return lines


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
