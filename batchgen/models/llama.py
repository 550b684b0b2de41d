"""Llama family on the paged KV cache: Llama 2/3 (llama3 rope scaling), SmolLM2, Mistral,
Qwen2/2.5 (qkv bias), Qwen3 (q/k RMSNorm), Phi-3/3.5/4 (fused checkpoint projections, partial
rotary, longrope) and Granite 3.x (four multipliers). Parameter names follow the HF checkpoints
so weights load by name. Qwen3-MoE and Mixtral (softmax_moe.py) are these stacks with routed
experts in place of the dense MLP (`_mlp_for`, `_load_other`)."""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn

from batchgen.forward_batch import ForwardBatch
from batchgen.models.base import DecoderStack, PagedCausalLM, PreNormDecoderLayer
from batchgen.models.attention import paged_attention
from batchgen.models.fp8 import QuantizedWeight, dequantize_blocks, pair_scales, weight_block_size
from batchgen.models.fp8_dense import Fp8Projections, feed_quantized_rows, is_fp8_checkpoint
from batchgen.models.layers import (SINGLE, FusedGatedMLP, RMSNorm, RotaryEmbedding,
                                    RowParallelLinear, default_max_positions, rope_inv_freq,
                                    softmax_scale, token_embedding)
from batchgen.models.tp_slices import narrow, rank_part, split_dim
from batchgen.parallel import TensorParallel

FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
"""Checkpoint projection -> (our fused parameter, its slot among the fused pieces)."""
TP_SPLIT = {
    **dict.fromkeys((".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight",
                     ".gate_up_proj.bias"), 0),
    **dict.fromkeys(("o_proj.weight", "down_proj.weight"), 1),
}
"""Tensor-parallel split of the checkpoint (tp_slices): the fused column-parallel projections
by output rows, each fused piece on its own (KV heads may be replicated, see _piece_part); the
row-parallel ones by input columns; the rest replicated."""


class Biases(NamedTuple):
    """Which projections carry a bias: each HF family decides, and not all read the config."""

    qkv: bool
    o: bool
    mlp: bool


class LlamaAttention(nn.Module):
    """Tensor parallel by heads: each rank holds its query heads and their KV heads (so its KV
    cache holds only those), and o_proj sums the ranks' partial outputs."""

    def __init__(self, cfg, layer: int, rope: RotaryEmbedding, biases: Biases, qk_norm: bool,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer = layer
        heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.heads = tp.split(heads, "num_attention_heads")
        self.kv_first, self.kv_heads = kv_head_share(
            getattr(cfg, "num_key_value_heads", None) or heads, tp)
        hidden = cfg.hidden_size
        # q, k and v in one matmul (one launch, better shapes); checkpoints load into its rows.
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=biases.qkv)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=biases.o, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rope = rope
        self.window = _sliding_window(cfg, layer)
        self.scale = softmax_scale(self.head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.heads, self.head_dim)
        k = k.reshape(-1, self.kv_heads, self.head_dim)
        v = v.reshape(-1, self.kv_heads, self.head_dim)
        rope = self.rope
        if self._norm_then_rope(q, batch):
            (q, k), rope = self._norm_and_rotate(q, k, batch), None
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = paged_attention(q, k, v, self.layer, batch, self.scale, window=self.window,
                              rope=rope)
        return self.o_proj(out.reshape(-1, self.heads * self.head_dim))

    def _norm_then_rope(self, q: torch.Tensor, batch: ForwardBatch) -> bool:
        """Whether q/k norms and RoPE run as one kernel: dense (embedding) steps on CUDA with
        plain per-head RMSNorms. Paged steps rotate k as they store it (rope_store) instead."""
        return (batch.dense is not None and q.is_cuda and type(self.q_norm) is RMSNorm
                and type(self.k_norm) is RMSNorm)

    def _norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor,
                         batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        from batchgen_kernels import rmsnorm_rope

        return rmsnorm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                            batch.positions, self.rope.cos, self.rope.sin)


def kv_head_share(kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, count) this rank holds. With fewer KV heads than ranks each KV head is
    replicated on TP / KVH ranks (the ones whose query heads read it)."""
    if kv_heads % tp.size == 0:
        count = kv_heads // tp.size
        return tp.rank * count, count
    if tp.size % kv_heads == 0:
        return tp.rank // (tp.size // kv_heads), 1
    tp.split(kv_heads, "num_key_value_heads")  # raises, naming the flag
    raise AssertionError("unreachable")


def _sliding_window(cfg, layer: int) -> int | None:
    """`layer`'s attention window as HF applies it: on the layers layer_types marks sliding, on
    all of them without layer_types. Qwen2/Qwen3 configs derive layer_types (sliding from
    max_window_layers on) only when a checkpoint lists none, and use_sliding_window off
    disables the window altogether (Qwen3-MoE has no layer_types: it windows every layer, as
    Mixtral does; Phi-3 too). HF's Llama and Granite have no window: a `sliding_window` left in
    their config.json (a converted Mistral or Qwen) changes nothing there, nor here."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "model_type", "") in ("llama", "granite"):
        return None
    layer_types = getattr(cfg, "layer_types", None)
    model_type = getattr(cfg, "model_type", "")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not getattr(cfg, "use_sliding_window",
                                                                      False):
        return None
    if model_type in ("qwen2", "qwen3") and not layer_types:
        return int(window) if layer >= getattr(cfg, "max_window_layers", 0) else None
    if layer_types and layer_types[layer] != "sliding_attention":
        return None
    return int(window)


MlpFor = Callable[[int], nn.Module | None]
"""Layer index -> the MLP a family puts there instead of the dense one (its MoE), or None."""


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg, layer: int, rope: RotaryEmbedding, biases: Biases, qk_norm: bool,
                 tp: TensorParallel, mlp_for: MlpFor | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, rope, biases, qk_norm, tp)
        self.mlp = mlp_for(layer) if mlp_for is not None else None
        if self.mlp is None:
            self.mlp = FusedGatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=biases.mlp,
                                     tp=tp, hidden_act=getattr(cfg, "hidden_act", None))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(DecoderStack):
    def __init__(self, cfg, biases: Biases, qk_norm: bool, tp: TensorParallel,
                 mlp_for: MlpFor | None = None):
        super().__init__()
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        inv_freq, scaling = rope_inv_freq(cfg, head_dim)
        rope = RotaryEmbedding(inv_freq, default_max_positions(cfg, quiet=True), scaling)
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, biases, qk_norm, tp, mlp_for)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(PagedCausalLM):
    """Also serves Mistral, Qwen2 and Qwen3 (the `biases` / `qk_norm` switches).

    Under tensor parallelism the embedding and LM head stay whole on every rank (replicated
    logits: each replica samples the same tokens without another collective)."""

    qk_norm = False
    checkpoint_fused = False
    """Whether the family's checkpoints hold q|k|v and gate|up fused (as ours) rather than
    as q_proj, k_proj, v_proj, gate_proj and up_proj."""
    supports_tensor_parallel = True
    fp8_projections = True
    """FP8 checkpoints' projections load through fp8_dense.Fp8Projections (their dense
    weights deferred on CUDA: fp8_dense.deferred_projections)."""

    @staticmethod
    def biases(hf_config) -> Biases:
        """Llama: `attention_bias` for q/k/v/o, `mlp_bias` for the MLP."""
        attention = bool(getattr(hf_config, "attention_bias", False))
        return Biases(attention, attention, bool(getattr(hf_config, "mlp_bias", False)))

    def __init__(self, hf_config, options=None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = hf_config
        self.options = options
        self.tp = tp
        self.model = self._stack(hf_config, tp)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        self.tie_weights()
        attn = self.model.layers[0].self_attn
        self.kv_token_shape = (2, attn.kv_heads, attn.head_dim)
        self.max_context = default_max_positions(hf_config)

    def _stack(self, hf_config, tp: TensorParallel) -> DecoderStack:
        """The decoder stack (a family with other layers builds its own: gemma3.py)."""
        return LlamaModel(hf_config, self.biases(hf_config), self.qk_norm, tp,
                          self._mlp_for(hf_config, tp))

    def _mlp_for(self, hf_config, tp: TensorParallel) -> MlpFor | None:
        """Which layers get another MLP than the dense one (none here; MoE subclasses)."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     presharded: bool = False) -> None:
        """`presharded`: the tensors are this TP rank's already (our per-rank converted files).
        FP8 checkpoints stay FP8 on CUDA (fp8_dense.py) and are dequantized elsewhere."""
        params = dict(self.named_parameters(remove_duplicate=False))
        weights, fp8 = self._fp8_reader(weights)
        seen: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or self._load_other(name, tensor,
                                                                       presharded):
                continue
            target, slot = _fused_target(name)
            if target not in params and "model." + target in params:  # a bare decoder stack
                target = "model." + target
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if not presharded:
                tensor = self._local_part(target, slot, tensor)
            pieces = [(slot, tensor)]
            if isinstance(tensor, QuantizedWeight):
                pieces = fp8.accept(target, slot, tensor)
            for piece_slot, dense in pieces:
                self._copy(params, name, target, piece_slot, dense)
            seen.add((target, slot))
        if fp8 is not None:
            fp8.check_done()
            feed_quantized_rows(self.model.layers)
        self._check_complete(params, seen)
        left = [n for n, p in self.named_parameters() if p.is_meta]
        if left:  # deferred for FP8 and never filled (checked above; a last guard)
            raise ValueError(f"checkpoint lacks {len(left)} tensors, e.g. {left[:3]}")

    def _load_other(self, name: str, tensor, presharded: bool) -> bool:
        """Place a tensor the dense layers have no place for (a subclass's MoE); True if
        placed. `tensor` may be a QuantizedWeight (FP8 kept as FP8)."""
        return False

    def _fp8_reader(self, weights):
        """(weights with FP8 scales paired, the FP8 installer or None)."""
        if not is_fp8_checkpoint(self.config):
            return weights, None
        dtype = self.model.embed_tokens.weight.dtype
        paired = pair_scales(weights, weight_block_size(self.config), self._keep_fp8(), dtype)
        return paired, Fp8Projections(self, self._piece_count, dtype)

    def _keep_fp8(self) -> bool:
        """FP8 GEMMs on CUDA; dequantized on CPU and with --pre-dequantize-weights."""
        on_cuda = self.model.embed_tokens.weight.device.type == "cuda"
        return on_cuda and not getattr(self.options, "pre_dequantize_weights", False)

    def _piece_count(self, target: str) -> int:
        return 3 if ".qkv_proj." in target else 2 if ".gate_up_proj." in target else 1

    def _copy(self, params: dict, name: str, target: str, slot: int, tensor: torch.Tensor) -> None:
        if params[target].is_meta:  # deferred for FP8, but this piece comes dense
            params[target] = self._materialize_deferred(target, tensor.device)
        rows = self._rows(target, slot)
        param = params[target][rows] if rows is not None else params[target]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                             f"shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)

    def _materialize_deferred(self, target: str, device: torch.device) -> nn.Parameter:
        """Storage in the model dtype for a projection weight left on meta for an FP8 one
        (fp8_dense.deferred_projections) that a dense tensor fills instead."""
        module = self.get_submodule(target[: -len(".weight")])
        dtype = self.model.embed_tokens.weight.dtype
        module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=dtype, device=device),
                                     requires_grad=False)
        return module.weight

    def _rows(self, target: str, slot: int) -> slice | None:
        """Rows of a fused parameter that checkpoint piece `slot` fills (None: all of it)."""
        if slot < 0:
            return None
        sizes = self._piece_sizes(target, local=True)
        start = sum(sizes[:slot])
        return slice(start, start + sizes[slot])

    def _piece_sizes(self, target: str, local: bool) -> list[int]:
        """Rows of each checkpoint piece inside fused qkv_proj / gate_up_proj."""
        if ".qkv_proj." not in target:
            mlp = self.get_submodule(target[: target.index(".gate_up_proj.")])
            inter = mlp.local_intermediate * (1 if local else self.tp.size)
            return [inter, inter]
        attn = self.model.layers[0].self_attn
        if local:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        cfg = self.config
        kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * attn.head_dim
        return [attn.q_size * self.tp.size, kv, kv]

    def _local_part(self, target: str, slot: int, tensor: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of a whole checkpoint tensor (TP_SPLIT): column-parallel
        projections by output rows, per fused piece; row-parallel ones by input columns."""
        dim = split_dim(target, TP_SPLIT)
        if self.tp.size == 1 or dim is None:
            return tensor
        if dim == 1:
            return rank_part(tensor, 1, self.tp, self._dtype)
        if slot >= 0:
            return self._piece_part(target, slot, tensor)
        if isinstance(tensor, QuantizedWeight):  # our whole fused layout in FP8: rare
            tensor = dequantize_blocks(tensor.weight, tensor.scale_inv, tensor.block,
                                       self.model.embed_tokens.weight.dtype)
        pieces = tensor.split(self._piece_sizes(target, local=False), dim=0)
        return torch.cat([self._piece_part(target, i, piece) for i, piece in enumerate(pieces)])

    def _piece_part(self, target: str, slot: int, piece):
        """This rank's rows of one fused piece: its query heads / features, its KV heads."""
        if ".qkv_proj." in target and slot > 0:
            attn = self.model.layers[0].self_attn
            return narrow(piece, 0, attn.kv_first * attn.head_dim, attn.kv_size, self._dtype)
        return rank_part(piece, 0, self.tp, self._dtype)

    @property
    def _dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _check_complete(self, params: dict, seen: set[tuple[str, int]]) -> None:
        whole = {name for name, slot in seen if slot < 0}  # our own (converted) layout
        missing = set()
        for name in params:
            pieces = 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 0
            if name not in whole and any((name, i) not in seen for i in range(max(pieces, 1))):
                missing.add(name)
        if getattr(self.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")
            if ("lm_head.weight", -1) in seen:
                missing.discard("model.embed_tokens.weight")
        elif "lm_head.weight" in missing and len(missing) == 1:
            # A bare decoder stack (an embedding model): it embeds, it never samples.
            self.generates = False
            self.lm_head.weight.zero_()  # the capture's forwards read it: no stray NaNs
            missing.clear()
        if missing:
            names = sorted(n for name in missing for n in self._checkpoint_names(name, seen))
            raise ValueError(f"checkpoint lacks {len(names)} tensors, e.g. {names[:3]}")

    def _checkpoint_names(self, param: str, seen: set[tuple[str, int]]) -> list[str]:
        """The checkpoint's names of what a missing parameter lacks: a fused projection's
        pieces that did not come (k_proj, up_proj: the names a user finds in the files), or the
        fused name itself where none came and the family's checkpoints hold it fused (Phi-3)."""
        parts = param.split(".")
        pieces = sorted((slot, piece) for piece, (fused, slot) in FUSED.items()
                        if len(parts) >= 2 and fused == parts[-2])
        came = [(param, slot) in seen for slot, _ in pieces]
        if not pieces or (self.checkpoint_fused and not any(came)):
            return [param]
        return [".".join(parts[:-2] + [piece, parts[-1]])
                for (_, piece), done in zip(pieces, came) if not done]


def _fused_target(name: str) -> tuple[str, int]:
    """'...self_attn.k_proj.weight' -> ('...self_attn.qkv_proj.weight', 1); others unchanged."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED:
        fused, slot = FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), slot
    return name, -1


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def biases(hf_config) -> Biases:
        """q/k/v always, o_proj and the MLP never, whatever the config says (as HF's Qwen2)."""
        return Biases(True, False, False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    @staticmethod
    def biases(hf_config) -> Biases:
        attention = bool(getattr(hf_config, "attention_bias", False))
        return Biases(attention, attention, False)


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def biases(hf_config) -> Biases:
        """None: HF's Mistral ignores `attention_bias` and `mlp_bias`."""
        return Biases(False, False, False)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4 (the dense ones): Llama's stack without biases. Their
    checkpoints hold q|k|v and gate|up already fused, in our row order: each loads whole into
    ours. A `sliding_window` applies to every layer (as HF's Phi-3); `partial_rotary_factor`
    (Phi-4-mini) rotates that share of each head; longrope's context stops at its
    original_max_position_embeddings (layers.default_max_positions)."""

    checkpoint_fused = True

    @staticmethod
    def biases(hf_config) -> Biases:
        """None: HF's Phi-3 has no bias anywhere."""
        return Biases(False, False, False)


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x: Llama (its bias flags too) with HF's four multipliers: the embedding times
    `embedding_multiplier`, each attention and MLP output times `residual_multiplier` before
    its residual add, `attention_multiplier` as the softmax scale (in place of
    1/sqrt(head_dim)) and the logits divided by `logits_scaling`. Each defaults to 1, as in
    HF's GraniteConfig."""

    def __init__(self, hf_config, options=None, tp: TensorParallel = SINGLE):
        super().__init__(hf_config, options, tp)
        multiplier = float(getattr(hf_config, "residual_multiplier", 1.0))
        scale = float(getattr(hf_config, "attention_multiplier", 1.0))
        self.model.embedding_multiplier = float(getattr(hf_config, "embedding_multiplier", 1.0))
        self.logits_scaling = float(getattr(hf_config, "logits_scaling", 1.0))
        for layer in self.model.layers:
            layer.residual_multiplier = multiplier
            layer.self_attn.scale = scale
