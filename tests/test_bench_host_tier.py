"""`batchgen bench --compare-host-tier`: the same workload with the host tier on and off (host
pool = device pool) at the same device pool, on a tiny SmolLM2 shape on CPU whose device pool
holds two sequences while the host holds many, so the "on" run unloads and reloads."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from batchgen.bench import Workload, host_tier_off, run_ours
from batchgen.bench_models import hf_config_for, random_model
from batchgen.config import EngineConfig, MemoryConfig

PAGE_BYTES = 2 * 2 * 16 * 2 * 4 * 64
"""Tiny SmolLM2 in float32: 2 layers x 2 KV heads x 16 dims x (K, V) x 4 bytes x 64 tokens."""
TINY_WORK = {"requests": 12, "input_len": 16, "output_len": 100, "output_dist": "lognormal",
             "max_output_len": 400}
"""Budgets of up to 416 tokens (7 pages): 16 device pages hold two sequences, 82 host pages
hold ten, and decodes outlast one decision window (128 tokens), so admissions unload."""


def gb(pages: float) -> float:
    return pages * PAGE_BYTES / 1e9


def test_compare_host_tier_reports_both_runs_with_the_same_tokens(tmp_path):
    from batchgen.cli import app

    out = tmp_path / "report.json"
    args = ["bench", "--shape", "smollm2-135m", "--tiny", "--device", "cpu",
            "--requests", "12", "--input-len", "16", "--output-len", "100",
            "--output-dist", "lognormal", "--max-output-len", "400", "--max-tokens-mode", "cap",
            "--max-decode-batch", "8", "--gpu-kv-cache-size", str(gb(16.5)),
            "--host-kv-cache-size", str(gb(82.5)), "--initial-gpu-page-buffer", "2",
            "--compare-host-tier", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "host_tier_off" in result.output and "same tokens" in result.output

    report = json.loads(out.read_text())
    assert report["config"]["initial_gpu_page_buffer"] == 2
    rows, tier = report["results"], report["host_tier"]
    want_tokens = sum(Workload(**TINY_WORK).lengths())
    for name in ("batchgen", "host_tier_off"):
        assert rows[name]["output_tokens"] == want_tokens  # every request ended at its length
        assert rows[name]["output_tok_s"] > 0
    assert tier["same_tokens"] and tier["on"]["tokens_sha256"] == tier["off"]["tokens_sha256"]
    assert tier["ratio"] == pytest.approx(
        rows["batchgen"]["output_tok_s"] / rows["host_tier_off"]["output_tok_s"])
    on, off = tier["on"], tier["off"]
    assert on["device_pages"] == off["device_pages"] == off["host_pages"] == 16
    assert on["host_pages"] == 82
    assert on["unloads"] > 0 and on["loads"] == on["unloads"]  # the host tier was used
    assert off["peak_host_pages"] <= 16 < on["peak_host_pages"]


def test_token_digest_follows_the_tokens_and_cap_mode_stops_at_the_drawn_length():
    """Greedy tokens do not depend on the budget the scheduler sees (cap vs exact), and the
    digest changes with the prompts (so agreeing digests mean agreeing tokens)."""
    model = random_model(hf_config_for("smollm2-135m", tiny=True), torch.float32,
                         torch.device("cpu"))
    roomy = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=gb(200.5),
                                             host_kv_cache_size=gb(200.5))).validate()
    small = dict(TINY_WORK, requests=4)
    exact = run_ours(model, roomy, Workload(**small, max_tokens_mode="exact"))
    cap = run_ours(model, roomy, Workload(**small, max_tokens_mode="cap"))
    other = run_ours(model, roomy, Workload(**small, max_tokens_mode="exact", seed=1))
    assert cap["output_tokens"] == exact["output_tokens"] == sum(exact["outputs"])
    assert cap["tokens_sha256"] == exact["tokens_sha256"]
    assert other["tokens_sha256"] != exact["tokens_sha256"]


def test_host_tier_off_pins_both_pools_to_the_device_page_count():
    class Layout:
        bytes_per_page = PAGE_BYTES

        def pages_for_bytes(self, num_bytes: float) -> int:
            return int(num_bytes // PAGE_BYTES)

    on = EngineConfig(memory=MemoryConfig(gpu_memory_frac=0.3, host_kv_cache_size=100.0))
    for pages in (1, 16, 1645, 123_457):
        off = host_tier_off(on, pages, Layout()).memory
        assert Layout().pages_for_bytes(off.gpu_kv_cache_size * 1e9) == pages
        assert Layout().pages_for_bytes(off.host_kv_cache_size * 1e9) == pages


def test_w2_lengths_have_mean_2k_and_max_16k():
    """W2's outputs: lognormal, sigma 1, uncapped mean 2048, cut at 16384."""
    lengths = Workload(requests=4096, output_len=2048, output_dist="lognormal",
                       max_output_len=16384).lengths()
    assert max(lengths) == 16384 and min(lengths) >= 1
    assert sum(lengths) / len(lengths) == pytest.approx(2048, rel=0.03)
    work = Workload(output_len=2048, output_dist="lognormal", max_tokens_mode="cap")
    assert work.sampling(300).max_tokens == 16384 and work.sampling(300).min_tokens == 0
    exact = Workload(max_tokens_mode="exact").sampling(300)
    assert exact.max_tokens == exact.min_tokens == 300


@pytest.mark.parametrize("bad,message", [
    ({"output_dist": "uniform"}, "output-dist"),
    ({"max_tokens_mode": "oracle"}, "max-tokens-mode"),
    ({"output_len": 20000}, "output-len"),
])
def test_workload_refuses_bad_options(bad, message):
    with pytest.raises(ValueError, match=message):
        Workload(**bad).validate()
