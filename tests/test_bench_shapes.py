"""`batchgen bench` shapes: the full DeepSeek-V3-4L / gpt-oss-20b sizes (meta models, no
memory), and their tiny variants run end to end on CPU through our engine and HF's twin."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from batchgen.bench import BenchConfig, Workload, bench
from batchgen.bench_report import format_table
from batchgen.bench_models import hf_config_for, hf_twin, random_model, weight_stats
from batchgen.config import ModelConfig
from batchgen.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVLayout, KVPool
from batchgen.models.loader import meta_model

CPU = torch.device("cpu")
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 77, 8]


@pytest.mark.parametrize("shape,params,active,gib", [
    ("deepseek-v3-4l", 36.96e9, 3.27e9, 68.8),  # the "37 B params, 69 GiB bf16"
    ("gpt-oss-20b", 20.91e9, 3.61e9, 12.8),  # OpenAI's 21 B / 3.6 B active; MXFP4 experts
    # Qwen's 30.5 B / 3.3 B activated and Mistral's 46.7 B / 12.9 B active count the embedding
    # lookup (0.31 B, 0.13 B) among the active parameters; weight_stats does not.
    ("qwen3-30b-a3b", 30.53e9, 3.04e9, 56.9),
    ("mixtral-8x7b", 46.70e9, 12.75e9, 87.0),
])
def test_full_shapes_have_the_published_sizes(shape, params, active, gib):
    stats = weight_stats(meta_model(hf_config_for(shape)).to(torch.bfloat16))
    assert stats["params"] == pytest.approx(params, rel=0.01)
    assert stats["active_params"] == pytest.approx(active, rel=0.05)
    assert stats["device_bytes"] / 2**30 == pytest.approx(gib, rel=0.02)


def test_deepseek_4l_layout_is_one_dense_then_three_moe_layers():
    cfg = hf_config_for("deepseek-v3-4l")
    model = meta_model(cfg)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["GatedMLP", "DeepseekMoE", "DeepseekMoE", "DeepseekMoE"]
    assert model.kv_token_shape == (1, 576)


def prefill_logits(model, prompt=PROMPT) -> torch.Tensor:
    layout = KVLayout(model.config.num_hidden_layers, model.kv_token_shape, torch.float32,
                      torch.float32)
    pool = KVPool(layout, 2, "cpu")
    batch = ForwardBatch.build([prompt], [0], [[0, 1]], [True], pool, CPU)
    with torch.inference_mode():
        return model(batch)[0]


@pytest.mark.parametrize("shape", ["deepseek-v3-4l", "gpt-oss-20b", "smollm2-135m",
                                   "qwen3-30b-a3b", "mixtral-8x7b"])
def test_hf_twin_shares_our_weights_and_matches_our_logits(shape):
    cfg = hf_config_for(shape, tiny=True)
    ours = random_model(cfg, torch.float32, CPU)
    hf = hf_twin(ours, cfg)
    assert (hf.model.embed_tokens.weight.data_ptr()
            == ours.model.embed_tokens.weight.data_ptr()), "the twin copied the embedding"
    with torch.inference_mode():
        want = hf(torch.tensor([PROMPT])).logits[0, -1].float()
    got = prefill_logits(ours)
    assert got.abs().max() > 0.01  # random weights give non-trivial logits
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def test_gpt_oss_packed_and_pre_dequantized_get_the_same_weights():
    cfg = hf_config_for("gpt-oss-20b", tiny=True)
    packed = random_model(cfg, torch.float32, CPU)
    dense = random_model(cfg, torch.float32, CPU, ModelConfig(pre_dequantize_weights=True))
    assert packed.packed and not dense.packed
    assert weight_stats(dense)["device_bytes"] > 3 * weight_stats(packed)["device_bytes"] / 2
    torch.testing.assert_close(prefill_logits(packed), prefill_logits(dense))


def test_deepseek_offloaded_experts_get_the_same_weights():
    cfg = hf_config_for("deepseek-v3-4l", tiny=True)
    resident = random_model(cfg, torch.float32, CPU)
    options = ModelConfig(enable_ep_with_offloading=True, ep_offloading_ratio=0.5)
    offloaded = random_model(cfg, torch.float32, CPU, options)
    stats = weight_stats(offloaded)
    assert stats["host_bytes"] > 0 and stats["params"] == weight_stats(resident)["params"]
    torch.testing.assert_close(prefill_logits(offloaded), prefill_logits(resident))
    with pytest.raises(ValueError, match="HF peer"):
        hf_twin(offloaded, cfg)


def test_deepseek_fp8_weights_load_as_block_quantized():
    """On CPU the loader dequantizes FP8 blocks: the weights sit on the e4m3 grid times
    one scale per 32x32 block (the tiny shapes' block)."""
    cfg = hf_config_for("deepseek-v3-4l", tiny=True, fp8_weights=True)
    model = random_model(cfg, torch.float32, CPU)
    w = model.model.layers[0].mlp.gate_proj.weight[:32, :32]
    scale = w.abs().max() / 448
    assert torch.equal((w / scale).to(torch.float8_e4m3fn).float() * scale, w)
    assert torch.isfinite(prefill_logits(model)).all()
    with pytest.raises(ValueError, match="FP8 block weights"):
        hf_config_for("gpt-oss-20b", fp8_weights=True)


@pytest.mark.parametrize("shape,extra", [
    ("deepseek-v3-4l", dict(peer="hf")),
    ("deepseek-v3-4l", dict(fp8_weights=True, enable_ep_with_offloading=True,
                            ep_offloading_ratio=0.3)),
    ("gpt-oss-20b", dict(peer="hf")),
    ("qwen3-30b-a3b", dict(fp8_weights=True, enable_ep_with_offloading=True,
                           ep_offloading_ratio=0.5)),
    ("mixtral-8x7b", dict(peer="hf")),
])
def test_tiny_shapes_run_through_bench(shape, extra):
    cfg = BenchConfig(shape=shape, tiny=True, device="cpu", peer_batch=3,
                      gpu_kv_cache_size=0.02, host_kv_cache_size=0.05, **extra)
    report = bench(cfg, Workload(requests=3, input_len=16, output_len=3))
    rows = report["results"]
    assert rows["batchgen"]["output_tok_s"] > 0
    assert ("hf_generate" in rows) == (extra.get("peer") == "hf")
    assert shape in format_table(report)


def test_bench_command_takes_the_model_options():
    from batchgen.cli import app

    result = CliRunner().invoke(app, [
        "bench", "--shape", "gpt-oss-20b", "--tiny", "--device", "cpu", "--requests", "2",
        "--input-len", "8", "--output-len", "2", "--pre-dequantize-weights",
        "--gpu-kv-cache-size", "0.02", "--host-kv-cache-size", "0.05"])
    assert result.exit_code == 0, result.output
    assert "gpt-oss-20b (float32)" in result.output
    refused = CliRunner().invoke(app, ["bench", "--shape", "deepseek-v3-4l", "--tiny",
                                       "--device", "cpu", "--ep-offloading-ratio", "0.3"])
    assert refused.exit_code == 2 and "enable-ep-with-offloading" in refused.output


def test_bench_prefill_budget_reaches_the_scheduler():
    """--max-prefill-tokens sizes the packed prefill steps: 4 prompts of 12 tokens take one
    step under the default budget and at least three under a 16-token one."""
    from batchgen.cli import app

    base = ["bench", "--shape", "llama3-8b", "--tiny", "--device", "cpu", "--requests", "4",
            "--input-len", "12", "--output-len", "2", "--gpu-kv-cache-size", "0.02",
            "--host-kv-cache-size", "0.05"]
    prefill_steps = []
    for extra in ([], ["--max-prefill-tokens", "16"]):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "report.json"
            result = CliRunner().invoke(app, [*base, *extra, "--json", str(out)])
            assert result.exit_code == 0, result.output
            stats = json.loads(out.read_text())["engine_stats"]
        prefill_steps.append(stats["steps"] - stats["times"]["decode_steps"])
    assert prefill_steps[0] == 1 and prefill_steps[1] >= 3, prefill_steps


def test_bench_measures_after_an_untimed_warm_up_and_splits_the_time():
    cfg = BenchConfig(shape="llama3-8b", tiny=True, device="cpu", gpu_kv_cache_size=0.02,
                      host_kv_cache_size=0.05, max_decode_batch=4, decode_burst_steps=4)
    work = Workload(requests=6, input_len=12, output_len=40)
    report = bench(cfg, work)
    stats = report["engine_stats"]
    times = stats["times"]
    # The warm-up's requests are not counted: only the timed run's tokens and finishes.
    assert report["results"]["batchgen"]["output_tokens"] == stats["generated_tokens"] == 6 * 40
    assert stats["finished"] == 6 and report["warmup_seconds"] > 0
    assert times["bursts"] > 0 and times["burst_steps"] <= 4 * times["bursts"]
    assert times["decode_steps"] >= times["burst_steps"]
    assert "batchgen time:" in format_table(report)
    # The CPU runs no compiled Triton kernel, so none is first launched in the timed run.
    assert stats["triton_variants_in_timed_run"] in (0, None)
    assert "Triton kernel variants" not in format_table(report)
    jit = dict(report, engine_stats={**stats, "triton_variants_in_timed_run": 2,
                                     "triton_variants_first_launched":
                                         "_decode_kernel[num_warps=1](q, kv) | _store_kernel[](k)"})
    note = format_table(jit)
    assert "note: 2 Triton kernel variants were first launched" in note
    assert "_decode_kernel[num_warps=1]; _store_kernel[]" in note


def test_triton_variant_counter_counts_compiles_and_restores_the_hook():
    """The counter sits on Triton's compile hook (called before each new variant is built),
    passes every call on to a hook that was there, and puts that hook back."""
    knobs = pytest.importorskip("triton").knobs
    from batchgen.bench import triton_variants_first_used

    calls = []
    outer = knobs.runtime.jit_cache_hook

    def earlier(*args, **kwargs):
        calls.append(kwargs["key"])
        return False

    knobs.runtime.jit_cache_hook = earlier
    try:
        with triton_variants_first_used() as seen:
            for key in ("a", "b"):
                assert knobs.runtime.jit_cache_hook(key=key, repr=key) is False
            # with the specialization data Triton hands the hook (which arguments differ)
            knobs.runtime.jit_cache_hook(key="c", repr="c",
                                         compile={"specialization_data": '{"sig": 1}'})
        assert seen == ["a", "b", 'c {"sig": 1}'] and calls == ["a", "b", "c"]
        assert knobs.runtime.jit_cache_hook is earlier
    finally:
        knobs.runtime.jit_cache_hook = outer


def test_bench_reports_offloaded_expert_copies():
    cfg = BenchConfig(shape="deepseek-v3-4l", tiny=True, device="cpu", gpu_kv_cache_size=0.02,
                      host_kv_cache_size=0.05, enable_ep_with_offloading=True,
                      ep_offloading_ratio=0.5)
    report = bench(cfg, Workload(requests=3, input_len=16, output_len=4))
    copies = report["engine_stats"]["expert_copies"]
    assert copies["experts"] > 0 and copies["bytes"] > 0
    assert "offloaded experts copied in" in format_table(report)


@pytest.mark.parametrize("shape,extra", [
    ("deepseek-v3-4l", {}),  # attention heads split, routed experts 8 + 8 (EP)
    ("deepseek-v3-4l", dict(enable_ep_with_offloading=True, ep_offloading_ratio=0.5)),
    ("qwen3-8b", {}),  # fused q/k/v and gate/up pieces sliced per rank
    ("qwen3-30b-a3b", {}),  # heads split, routed experts 4 + 4 (EP)
])
def test_tensor_parallel_bench_gives_the_one_rank_tokens(shape, extra):
    """Two CPU ranks over gloo, each drawing the whole checkpoint and keeping its slice: in
    float32 the group's greedy tokens are the one-rank run's."""
    base = dict(shape=shape, tiny=True, device="cpu", dtype="float32", gpu_kv_cache_size=0.02,
                host_kv_cache_size=0.05, max_decode_batch=4, **extra)
    work = Workload(requests=5, input_len=20, output_len=12)
    one = bench(BenchConfig(**base), work)
    two = bench(BenchConfig(**base, tensor_parallel_size=2), work)
    assert two["tokens_sha256"] == one["tokens_sha256"]
    assert two["config"]["tensor_parallel_size"] == 2 and "2 x cpu (TP 2" in two["device"]
    assert two["weights"]["device_bytes"] < 0.75 * one["weights"]["device_bytes"]  # a slice each


def test_tensor_parallel_bench_refuses_what_the_group_cannot_run(monkeypatch):
    from batchgen.bench_tp import check_group

    work = Workload(requests=2, input_len=8, output_len=2)
    with pytest.raises(ValueError, match="--peer hf"):
        check_group(BenchConfig(shape="llama3-8b", tiny=True, peer="hf", tensor_parallel_size=2),
                    work)
    with monkeypatch.context() as patch:  # one GPU for two ranks: refused, not run on the CPU
        patch.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(ValueError, match="needs 2 GPUs; this machine has 1"):
            check_group(BenchConfig(shape="llama3-8b", tiny=True, tensor_parallel_size=2), work)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        check_group(BenchConfig(shape="llama3-8b", tiny=True, device="cpu",
                                tensor_parallel_size=3), work)


def test_bench_fp8_scales_flag():
    """--fp8-scales tensor runs (row-scaled FP8 weights, dequantized on CPU); it needs
    --fp8-weights and a known kind, and says so."""
    from batchgen.cli import app

    base = ["bench", "--shape", "llama3-8b", "--tiny", "--device", "cpu", "--requests", "2",
            "--input-len", "8", "--output-len", "2", "--gpu-kv-cache-size", "0.02",
            "--host-kv-cache-size", "0.05"]
    result = CliRunner().invoke(app, [*base, "--fp8-weights", "--fp8-scales", "tensor"])
    assert result.exit_code == 0, result.output
    for extra, message in ((["--fp8-scales", "tensor"], "add --fp8-weights"),
                           (["--fp8-weights", "--fp8-scales", "rows"], "one of block, tensor")):
        refused = CliRunner().invoke(app, [*base, *extra])
        assert refused.exit_code == 2 and message in refused.output, refused.output
