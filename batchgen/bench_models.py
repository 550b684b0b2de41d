"""The models of `batchgen bench`: real shapes with random weights, and HF's twin of each.

- `hf_config_for(shape)`: the HF config of a named shape (optionally shrunk for CPU smoke runs).
- `random_model`: our model with random weights drawn on the device one tensor at a time and fed
  through the model's own `load_weights`, as a checkpoint would be: DeepSeek's routed experts
  by per-expert name (offloaded ones land in host memory), FP8 block-quantized linears on
  request, gpt-oss experts as MXFP4 blocks + scales. Storage is allocated once, in the final
  dtype (a float32 detour would need 148 GB for deepseek-v3-4l).
- `hf_twin`: HF transformers' model of the same config holding *our* tensors (assigned, not
  copied, where the layouts agree), so a 69 GiB model is not held twice.
- `weight_stats`: parameters (all / active per token) and device bytes, for the roofline.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from batchgen.models.hf_text import text_only

DEEPSEEK_V3_4L = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
    # DeepSeek-V3 has 3 dense layers of 61; with 4 layers, 1 dense + 3 MoE gives the
    # "37 B parameters, 69 GiB in bf16" of the issue (3 dense + 1 MoE would be 15 B).
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088,
    hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
    swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                       "factor": 32.0, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]},
    tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
MIXTRAL_8X7B = dict(
    architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SHAPES = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
                         hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                      hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False),
    "llama3-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                       hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, tie_word_embeddings=False),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0,
                     tie_word_embeddings=False),
    "deepseek-v3-4l": DEEPSEEK_V3_4L,
    "gpt-oss-20b": GPT_OSS_20B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "mixtral-8x7b": MIXTRAL_8X7B,
}
TINY = {
    "deepseek-v3-4l": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
                           qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=16, n_group=4,
                           topk_group=2, num_experts_per_tok=4, max_position_embeddings=4096),
    "gpt-oss-20b": dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"] * 2,
                        max_position_embeddings=4096, eos_token_id=2, pad_token_id=0),
    "qwen3-30b-a3b": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, eos_token_id=2),
    "mixtral-8x7b": dict(vocab_size=512, hidden_size=64, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                         eos_token_id=2),
}
"""Per-shape overrides of `--tiny`: the same layer pattern and options at toy widths."""
FP8_BLOCK = {False: (128, 128), True: (32, 32)}
"""DeepSeek's FP8 weight block (full shapes, tiny shapes: the tiny experts are 32 wide)."""
EMBED_SHAPES = {
    "qwen3-embedding-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151669, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
"""The shapes `batchgen bench --mode embeddings` runs (bench_embed)."""
FP8_SCALES = ("block", "tensor")
"""Scales of random FP8 checkpoints: 128x128 blocks (DeepSeek's, in `weight_scale_inv`) or
one per matrix (AutoFP8's for Llama, in `weight_scale`, with no weight_block_size)."""


def hf_config_for(shape: str, tiny: bool = False, fp8_weights: bool | str = False):
    """The HF config of a bench shape; `fp8_weights` (True or one of FP8_SCALES; True is
    "block") adds an FP8 quantization_config: DeepSeek's block one, or AutoFP8's per-tensor
    one (dense shapes load both through models/fp8_dense.py)."""
    text_only()
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)} (with --mode "
                         f"embeddings: {', '.join(EMBED_SHAPES)})")
    spec = dict(SHAPES[shape])
    if tiny:
        spec.update(TINY.get(shape, dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16)))
    if fp8_weights:
        if spec["model_type"] == "gpt_oss":
            raise ValueError("--fp8-weights: gpt-oss ships MXFP4 experts, not FP8 block weights")
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if fp8_weights in (True, "block"):
            quant["weight_block_size"] = list(FP8_BLOCK[tiny])
        elif fp8_weights != "tensor":
            raise ValueError(f"FP8 scales {fp8_weights!r}: one of {', '.join(FP8_SCALES)}")
        spec["quantization_config"] = quant
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


# -- random weights ---------------------------------------------------------------------------
def random_model(hf_config, dtype: torch.dtype, device: torch.device, options=None,
                 seed: int = 0, tp=None) -> nn.Module:
    """Our model with random weights drawn on `device` (no checkpoint, no download), loaded
    through its own `load_weights`; N(0, 0.02) matrices, ones for norms. With `tp` (a
    TensorParallel of size > 1) each rank draws the whole checkpoint with the same seed and
    keeps its slice, so the group holds exactly the one-device model's weights."""
    from batchgen.models.loader import materialize, meta_model

    model = materialize(meta_model(hf_config, options, tp).to(dtype), device, hf_config,
                        options)
    whole = model if tp is None or tp.size == 1 else meta_model(hf_config)
    model.load_weights(random_checkpoint(checkpoint_specs(whole), dtype, device,
                                         fp8_checkpoint_scales(hf_config), seed))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # FP8 swaps free the bf16 placeholders: return them
    return model.eval()


def stand_in_model(hf_config, dtype: torch.dtype, device: torch.device,
                   options=None) -> nn.Module | None:
    """`hf_config`'s model with only its first two and last two decoder layers (and their
    layer_types), random weights: it launches the kernel variants the whole model launches
    (start-up's precompile pass runs it before the real weights load). None for a model whose
    forwards need their kernels' outputs (`probe_without_kernels` off: MoE routing), which
    that pass cannot run, so nothing is drawn for it."""
    from batchgen.models.registry import model_class

    if not getattr(model_class(hf_config), "probe_without_kernels", False):
        return None
    cfg = copy.deepcopy(hf_config)
    total = cfg.num_hidden_layers
    keep = sorted({0, 1, total - 2, total - 1} & set(range(total)))
    cfg.num_hidden_layers = len(keep)
    types = getattr(cfg, "layer_types", None)
    if types:
        cfg.layer_types = [types[i] for i in keep]
    return random_model(cfg, dtype, device, options)


def checkpoint_specs(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of each tensor a checkpoint of `model` holds, in module order.

    kind: "ones" (norm weights), "normal", "linear" (a matrix real FP8 checkpoints quantize),
    "mxfp4_blocks" / "mxfp4_scales". Names and shapes only, so no tensor is kept alive.
    Our fused projections are listed as HF's separate ones, as real checkpoints hold them
    (each FP8-quantized on its own; tensor-parallel loaders slice each piece)."""
    from batchgen.models.gpt_oss import ExpertWeights
    from batchgen.models.moe import RoutedExperts
    from batchgen.models.mxfp4 import BLOCK

    specs: list[tuple[str, tuple[int, ...], str]] = []
    seen: set[int] = set()
    done: list[str] = []  # expert containers already described whole
    for mod_name, module in model.named_modules():
        if any(mod_name.startswith(prefix) for prefix in done):
            continue
        if isinstance(module, RoutedExperts):
            h, i = module.hidden, module.inter
            for e in range(getattr(module, "total_experts", module.num_experts)):
                for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)),
                                    ("down_proj", (h, i))):
                    specs.append((f"{mod_name}.{e}.{proj}.weight", shape, "linear"))
            done.append(mod_name + ".")
            continue
        if isinstance(module, ExpertWeights):
            experts, out, inp = module.shape
            specs.append((mod_name + "_blocks", (experts, out, inp // BLOCK, BLOCK // 2),
                          "mxfp4_blocks"))
            specs.append((mod_name + "_scales", (experts, out, inp // BLOCK), "mxfp4_scales"))
            done.append(mod_name + ".")
            continue
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied to a parameter already listed
                continue
            seen.add(id(param))
            name = f"{mod_name}.{pname}" if mod_name else pname
            kind = _kind(name, module, pname)
            for piece, rows in _fused_pieces(model, name, param.shape[0]):
                specs.append((piece, (rows, *param.shape[1:]), kind))
    return specs


def _kind(name: str, module: nn.Module, pname: str) -> str:
    if "norm" in type(module).__name__.lower():
        return "ones"
    is_matrix = isinstance(module, nn.Linear) and pname == "weight" and module.bias is None
    in_block = ".self_attn." in name or ".mlp." in name
    return "linear" if is_matrix and in_block and ".mlp.gate." not in name else "normal"


def fp8_checkpoint_scales(hf_config) -> tuple[int, int] | str | None:
    """How a random checkpoint of `hf_config` quantizes its linears: a block size, "tensor"
    (an FP8 config without weight_block_size, as AutoFP8's), or None (not FP8)."""
    from batchgen.models.fp8 import quantization_config, weight_block_size
    from batchgen.models.fp8_dense import is_fp8_checkpoint

    if not is_fp8_checkpoint(hf_config):
        return None
    has_block = quantization_config(hf_config).get("weight_block_size")
    return weight_block_size(hf_config) if has_block else "tensor"


def random_checkpoint(specs, dtype: torch.dtype, device: torch.device,
                      fp8_scales: tuple[int, int] | str | None = None,
                      seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Draw the tensors of `specs` on `device`, one at a time. With `fp8_scales`, "linear"
    matrices come as e4m3 `weight` + `weight_scale_inv` (a block size: as DeepSeek's FP8
    checkpoints) or + one `weight_scale` ("tensor": as AutoFP8's)."""
    from batchgen.models.fp8 import FP8, FP8_MAX, quantize_blocks

    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape, kind in specs:
        if kind == "ones":
            yield name, torch.ones(shape, dtype=dtype, device=device)
        elif kind == "mxfp4_blocks":  # uniform e2m1 codes: +-{0, .5, 1, 1.5, 2, 3, 4, 6}
            yield name, torch.randint(0, 256, shape, dtype=torch.uint8, device=device,
                                      generator=gen)
        elif kind == "mxfp4_scales":  # 2^-8..2^-6: values of rms ~0.02
            yield name, torch.randint(119, 122, shape, dtype=torch.uint8, device=device,
                                      generator=gen)
        else:
            w = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
            if kind == "linear" and fp8_scales == "tensor":
                scale = w.abs().amax().float() / FP8_MAX
                wq = (w.float() / scale).to(FP8)
                del w
                yield name, wq
                yield name + "_scale", scale
            elif kind == "linear" and fp8_scales is not None:
                wq, scale = quantize_blocks(w, fp8_scales)
                del w
                yield name, wq
                yield name + "_scale_inv", scale
            else:
                yield name, w


# -- HF's twin --------------------------------------------------------------------------------
def hf_twin(model: nn.Module, hf_config) -> nn.Module:
    """HF's `AutoModelForCausalLM` of `hf_config` on our weights: tensors are assigned, not
    copied, where the layouts agree (fused projections are split as views, gpt-oss experts
    transposed as views); only MXFP4 experts are materialised, dequantized."""
    from transformers import AutoModelForCausalLM

    device = next(model.parameters()).device
    dtype = model.model.embed_tokens.weight.dtype
    config = copy.deepcopy(hf_config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # HF gets dense weights; it would quantize them again
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    wanted = set(hf.state_dict())
    hf.load_state_dict(hf_state_dict(model, wanted), strict=False, assign=True)
    hf.requires_grad_(False)
    _rebuild_meta_buffers(hf, device)
    missing = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if missing:
        raise ValueError(f"HF peer: no weights for {len(missing)} tensors, e.g. {missing[:3]}")
    return hf.eval()


def hf_state_dict(model: nn.Module, wanted: set[str]) -> dict[str, torch.Tensor]:
    """Our tensors under HF's names (views where possible)."""
    from batchgen.models.fp8 import Fp8Linear
    from batchgen.models.gpt_oss import ExpertWeights
    from batchgen.models.moe import RoutedExperts
    from batchgen.models.mxfp4 import dequantize_mxfp4

    dtype = model.model.embed_tokens.weight.dtype
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear) or (isinstance(module, RoutedExperts)
                                             and (module.num_offloaded or module.block)):
            raise ValueError("the HF peer needs every weight on the device in the model dtype: "
                             "run it without --fp8-weights and expert offloading")
        if isinstance(module, ExpertWeights):  # ours [E, out, in]; HF's [E, in, out]
            for part in ("blocks", "scales", "weight"):
                state.pop(f"{name}.{part}", None)
            dense = (dequantize_mxfp4(module.blocks, module.scales, dtype) if module.packed
                     else module.weight)
            state[name] = dense.transpose(1, 2)
    for name in [n for n in state if n not in wanted]:
        state.update(_unfused(model, name, state.pop(name)))
    return state


def _unfused(model: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our fused qkv_proj / gate_up_proj as HF's separate projections (row views)."""
    pieces = _fused_pieces(model, name, tensor.shape[0])
    if pieces == [(name, tensor.shape[0])]:
        return {}  # ours only (none today): HF's meta check reports anything left unfilled
    return dict(zip((n for n, _ in pieces), tensor.split([rows for _, rows in pieces])))


def _fused_pieces(model: nn.Module, name: str, rows: int) -> list[tuple[str, int]]:
    """(HF name, rows) of each projection our fused `name` holds (qkv_proj: q, k, v;
    gate_up_proj: gate, up), or [(name, rows)] for a tensor that is not fused."""
    if ".qkv_proj." in name:
        attn = model.model.layers[0].self_attn
        sizes = (attn.q_size, attn.kv_size, attn.kv_size)
        return [(name.replace("qkv_proj", p), n) for p, n in zip(("q_proj", "k_proj", "v_proj"),
                                                                  sizes)]
    if ".gate_up_proj." in name and ".experts." not in name:
        return [(name.replace("gate_up_proj", p), rows // 2) for p in ("gate_proj", "up_proj")]
    return [(name, rows)]


def _rebuild_meta_buffers(hf: nn.Module, device: torch.device) -> None:
    """Computed buffers (rotary inv_freq) were built on meta with the model: build again."""
    for name, module in list(hf.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if "rotary" not in type(module).__name__.lower():
            raise ValueError(f"HF peer: cannot rebuild the buffers of {name} ({type(module)})")
        with torch.device(device):  # the signature varies across versions; config is common
            hf.set_submodule(name, type(module)(config=hf.config))


# -- sizes ------------------------------------------------------------------------------------
def weight_stats(model: nn.Module) -> dict:
    """params: all weights; active_params: those one token multiplies by (k of E routed
    experts; not the embedding table, a lookup; OpenAI counts gpt-oss-20b's 3.6 B so);
    device_bytes: weight bytes on the device (what a large decode step reads); host_bytes:
    offloaded experts (streamed over PCIe, outside the HBM roofline)."""
    from batchgen.models.gpt_oss import ExpertWeights
    from batchgen.models.moe import RoutedExperts

    cfg = model.config
    k = getattr(cfg, "num_experts_per_tok", None) or 1
    stats = dict(params=0, active_params=0.0, device_bytes=0, host_bytes=0)
    experts = [m for m in model.modules() if isinstance(m, (RoutedExperts, ExpertWeights))]
    inside = {id(t) for m in experts for t in [*m.parameters(), *m.buffers()]}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for t in model.parameters():  # unique: a tied LM head counts once
        if id(t) in inside:
            continue
        stats["params"] += t.numel()
        stats["active_params"] += 0 if id(t) in lookups else t.numel()  # a lookup, no FLOPs
        stats["device_bytes"] += t.numel() * t.element_size()
    for m in experts:
        if isinstance(m, RoutedExperts):
            count, total = 3 * m.hidden * m.inter * m.num_experts, m.num_experts
            if m.host is not None:
                stats["host_bytes"] += sum(t.numel() * t.element_size() for t in m.host.tensors())
        else:
            count, total = m.shape[0] * m.shape[1] * m.shape[2], m.shape[0]
        stats["params"] += count
        stats["active_params"] += count * min(k, total) / total
        stats["device_bytes"] += sum(t.numel() * t.element_size()
                                     for t in [*m.parameters(recurse=False),
                                               *m.buffers(recurse=False)])
    return stats
