"""`batchgen bench --compare-prefix-caching`: the same workload again with the prefix cache
off, after the run with it on (which bench.py has timed); both, their ratio, and whether
their tokens agree (greedy: on CPU in float32 they must; on CUDA batches differ between the
runs and bf16 rounding may flip near-tied logits of random weights)."""

from __future__ import annotations

from dataclasses import replace

from batchgen.config import EngineConfig


def caching_off(engine_cfg: EngineConfig) -> EngineConfig:
    """`engine_cfg` with the prefix cache off (every request prefills its whole prompt)."""
    scheduler = replace(engine_cfg.scheduler, enable_prefix_caching=False)
    return replace(engine_cfg, scheduler=scheduler).validate()


def comparison(on: dict, off: dict, on_row: dict, off_row: dict) -> dict:
    """The report's section: ratio of output tok/s, token agreement, reuse in each run."""
    def side(run: dict) -> dict:
        stats = run["stats"]
        return {"tokens_sha256": run["tokens_sha256"], "seconds": run["seconds"],
                "prefix_hit_rate": stats["prefix_hit_rate"],
                "cached_prompt_tokens": stats["cached_prompt_tokens"],
                "prompt_tokens": stats["prompt_tokens"], "forks": stats["forks"],
                "shared_tails": stats["shared_tails"],
                "peak_device_pages": stats["peak_device_pages"], "steps": stats["steps"]}

    return {"ratio": on_row["output_tok_s"] / off_row["output_tok_s"],
            "same_tokens": on["tokens_sha256"] == off["tokens_sha256"],
            "on": side(on), "off": side(off)}


def table_lines(section: dict, device: str) -> list[str]:
    if section["same_tokens"]:
        same = "same tokens"
    elif "cuda" in device:
        same = "tokens differ (expected on CUDA: batch-dependent bf16 rounding)"
    else:
        same = "TOKENS DIFFER (a prefix cache bug)"
    lines = [f"prefix caching on (batchgen) / off output tok/s: {section['ratio']:.2f}x, {same}",
             f"{'caching':<10}{'seconds':>10}{'hit rate':>10}{'cached tokens':>15}"
             f"{'forks':>8}{'page starts':>13}{'peak dev pages':>16}{'steps':>9}"]
    for name in ("on", "off"):
        s = section[name]
        lines.append(f"{name:<10}{s['seconds']:>10.2f}{s['prefix_hit_rate']:>10.1%}"
                     f"{s['cached_prompt_tokens']:>15,}{s['forks']:>8,}{s['shared_tails']:>13,}"
                     f"{s['peak_device_pages']:>16,}{s['steps']:>9,}")
    return lines
