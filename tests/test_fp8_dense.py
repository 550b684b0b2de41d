"""FP8 checkpoints of dense (Llama-family) models: e4m3 projections with block scales
(`weight_scale_inv`) or one scale per tensor or output channel (`weight_scale`), as our own
quantizer writes them.
On CPU they are dequantized at load; the FP8 modules CUDA keeps are exercised here too (their
matmul dequantizes on CPU), so both must give the logits of the dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import save_tiny_model

from batchgen.models.fp8 import Fp8Linear, dequantize_blocks, quantize_blocks
from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.loader import build_model, load_hf_config, read_safetensors
from engine_utils import greedy_requests, make_engine

BLOCK = (16, 16)


def write_fp8(src, dst, scales: str):
    """Quantize every projection of `src` into `dst` (and `dst/dequant`: the values it holds)."""
    dst.mkdir()
    (dst / "dequant").mkdir()
    state = load_file(str(src / "model.safetensors"))
    quantized, dense = {}, {}
    for name, w in state.items():
        if name.endswith("proj.weight"):
            if scales in ("tensor", "channel"):
                amax = w.abs().max() if scales == "tensor" else w.abs().amax(1, keepdim=True)
                scale = amax.float() / 448.0
                q = (w / scale).to(torch.float8_e4m3fn)
                quantized[name], quantized[name[:-len("weight")] + "weight_scale"] = q, scale
                quantized[name[:-len("weight")] + "input_scale"] = torch.tensor(1.0)
                dense[name] = q.float() * scale
            else:
                q, scale = quantize_blocks(w, BLOCK)
                quantized[name], quantized[name + "_scale_inv"] = q, scale
                dense[name] = dequantize_blocks(q, scale, BLOCK)
        else:
            quantized[name] = dense[name] = w
    config = json.loads((src / "config.json").read_text())
    (dst / "dequant" / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    if scales == "channel":  # as llm-compressor's FP8_DYNAMIC scheme writes it
        config["quantization_config"] = compressed_tensors_config("float", 8)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(quantized, str(dst / "model.safetensors"))
    save_file(dense, str(dst / "dequant" / "model.safetensors"))


def compressed_tensors_config(kind: str, bits: int) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": bits, "type": kind, "strategy": "channel",
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": bits, "type": kind, "strategy": "token",
                                      "dynamic": True}}}}


def load(folder, keep_fp8=False, monkeypatch=None, deferred=False):
    """`deferred`: the projections' weights left on meta until loaded, as on CUDA
    (fp8_dense.deferred_projections), here on the CPU; asserts some were."""
    if keep_fp8:
        monkeypatch.setattr(LlamaForCausalLM, "_keep_fp8", lambda self: True)
    left = []
    if deferred:
        import batchgen.models.fp8_dense as fp8_dense

        as_on_cuda = fp8_dense.deferred_projections

        def deferring(model, hf_config, device, options=None):
            left.extend(as_on_cuda(model, hf_config, torch.device("cuda"), options))
            return left
        monkeypatch.setattr(fp8_dense, "deferred_projections", deferring)
    model = build_model(load_hf_config(folder), read_safetensors(folder), torch.float32,
                        torch.device("cpu"))
    assert bool(left) == deferred
    return model


def tokens(model, n=24):
    prompts = [[1 + (i * 5 + j * 11) % 500 for j in range(m)] for i, m in enumerate((7, 70))]
    done = make_engine(model).generate(greedy_requests(prompts, n, logprobs=True))
    return [(d.completions[0].token_ids, [lp.logprob for lp in d.completions[0].logprobs])
            for d in done]


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("scales", ["block", "tensor", "channel"])
@pytest.mark.parametrize("keep_fp8", [False, True], ids=["dequantized", "fp8-modules"])
@pytest.mark.parametrize("deferred", [False, True], ids=["materialised", "deferred"])
def test_fp8_checkpoint_equals_its_dequantized_weights(tmp_path, monkeypatch, family,
                                                       scales, keep_fp8, deferred):
    """`deferred`: the projections' weights stay on meta until the checkpoint's arrive (as
    on CUDA): FP8 ones replace the modules, dense ones (dequantized here) get storage then."""
    src = save_tiny_model(family, tmp_path / "src")
    write_fp8(src, tmp_path / "fp8", scales)
    ours = load(tmp_path / "fp8", keep_fp8, monkeypatch, deferred)
    assert not any(p.is_meta for p in ours.parameters())
    reference = load(tmp_path / "fp8" / "dequant")
    fp8_modules = [m for m in ours.modules() if isinstance(m, Fp8Linear)]
    # q|k|v and gate|up fused: 4 FP8 projections per layer when kept
    assert len(fp8_modules) == (4 * ours.config.num_hidden_layers if keep_fp8 else 0)
    assert all(m.row_scaled == (scales != "block") for m in fp8_modules)
    got, want = tokens(ours), tokens(reference)
    for (t, lp), (rt, rlp) in zip(got, want):
        assert t == rt
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(rlp), rtol=1e-4, atol=1e-4)


def test_qwen2_biased_qkv_stays_dense(tmp_path, monkeypatch):
    """Fp8Linear has no bias: q/k/v with a bias are dequantized, the rest stays FP8."""
    src = save_tiny_model("qwen2", tmp_path / "src")
    write_fp8(src, tmp_path / "fp8", "block")
    ours = load(tmp_path / "fp8", True, monkeypatch, deferred=True)  # o_proj etc. deferred
    layer = ours.model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    assert isinstance(layer.self_attn.o_proj, Fp8Linear)
    assert ([t for t, _ in tokens(ours)]
            == [t for t, _ in tokens(load(tmp_path / "fp8" / "dequant"))])


@pytest.mark.parametrize("scales", ["block", "tensor"])
def test_our_fused_layout_in_fp8_installs_whole(monkeypatch, scales):
    """`batchgen bench --fp8-weights [--fp8-scales tensor]` on a dense shape: our fused q|k|v
    and gate|up come as one FP8 tensor each (no pieces to join) and must become Fp8Linear
    modules directly; row-scaled ones get their input quantized by the norms before them."""
    from batchgen.bench_models import hf_config_for, random_model

    monkeypatch.setattr(LlamaForCausalLM, "_keep_fp8", lambda self: True)
    model = random_model(hf_config_for("llama3-8b", tiny=True, fp8_weights=scales),
                         torch.float32, torch.device("cpu"))
    kept = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(kept) == 4 * model.config.num_hidden_layers
    assert all(m.row_scaled == (scales == "tensor") for m in kept)
    norms = [layer.input_layernorm.fp8_rows for layer in model.model.layers]
    assert norms == [scales == "tensor"] * model.config.num_hidden_layers
    assert all(t for t, _ in tokens(model, 4))


def test_compressed_tensors_schemes_other_than_fp8_are_refused(tmp_path):
    src = save_tiny_model("llama", tmp_path / "src")
    write_fp8(src, tmp_path / "fp8", "channel")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = compressed_tensors_config("int", 4)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="compressed-tensors checkpoint with int4 weights"):
        load(tmp_path / "fp8")


def test_only_unbiased_projections_of_an_fp8_checkpoint_kept_fp8_are_deferred(tmp_path):
    """On CUDA (FP8 kept) the four projections of every layer wait on meta for their FP8
    tensors; a biased one (Qwen2's q|k|v), the CPU, --pre-dequantize-weights or a checkpoint
    that is not FP8 defer nothing."""
    from types import SimpleNamespace

    from batchgen.models.fp8_dense import deferred_projections
    from batchgen.models.loader import meta_model

    src = save_tiny_model("qwen2", tmp_path / "src")
    write_fp8(src, tmp_path / "fp8", "block")
    config = load_hf_config(tmp_path / "fp8")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def deferred(cfg, device, **options):
        names = [n for n, _ in deferred_projections(meta_model(cfg), cfg, device,
                                                    SimpleNamespace(**options))]
        return sorted({n.rsplit(".", 1)[-1] for n in names}), len(names)

    layers = config.num_hidden_layers
    assert deferred(config, cuda) == (["down_proj", "gate_up_proj", "o_proj"], 3 * layers)
    assert deferred(config, cpu) == ([], 0)
    assert deferred(config, cuda, pre_dequantize_weights=True) == ([], 0)
    assert deferred(load_hf_config(tmp_path / "fp8" / "dequant"), cuda) == ([], 0)
