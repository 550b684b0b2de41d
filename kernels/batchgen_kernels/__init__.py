"""Triton kernels for batchgen, installed as `batchgen_kernels`.

Each module holds one kernel, its typed launcher (shapes in the docstring; a broken precondition
raises ValueError, a wrong dtype TypeError) and notes on the algorithm; `reference` holds the
pure-PyTorch definitions they are tested against. On a machine without a GPU they run under
TRITON_INTERPRET=1.
"""

from .decode_attention import paged_decode_attention
from .fp8_rows import quantize_fp8_rows
from .kv_store import store_kv
from .mla_decode import mla_decode_attention
from .mla_kv_store import store_mla_kv
from .moe_gemm import grouped_gemm, grouped_gemm_fp8, quantize_fp8_groups
from .moe_routing import deepseek_route
from .prefill_attention import paged_prefill_attention
from .rmsnorm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_fp8,
    rmsnorm,
    rmsnorm_fp8,
    rmsnorm_heads,
)
from .rmsnorm_rope import rmsnorm_rope
from .rope import apply_rope
from .rope_store import rope_store_kv
from .shared_prefix_attention import plan_shared_prefix, shared_prefix_decode
from .silu_mul import silu_and_mul, silu_and_mul_fp8

__all__ = [
    "apply_rope",
    "deepseek_route",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_fp8",
    "grouped_gemm",
    "grouped_gemm_fp8",
    "mla_decode_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_shared_prefix",
    "quantize_fp8_groups",
    "quantize_fp8_rows",
    "rmsnorm",
    "rmsnorm_fp8",
    "rmsnorm_heads",
    "rmsnorm_rope",
    "rope_store_kv",
    "shared_prefix_decode",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "store_kv",
    "store_mla_kv",
]
