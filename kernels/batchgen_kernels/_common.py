"""Helpers shared by the kernels: launcher precondition checks and small @triton.jit pieces.

Two Triton 3.9 interpreter defects shape the jit helpers (both found by the CPU tests):
- `tl.dot` on bfloat16 operands multiplies their raw bit patterns, so `dot` upcasts to float32
  when the launcher asks for it (always under the interpreter, and for float32 inputs on GPU
  where it also selects IEEE instead of TF32 precision).
- float32 -> float8 casts mis-round when the mantissa carries into the exponent, so
  `round_to_e4m3` snaps values onto the e4m3 grid in float32 first; the cast is then exact on
  every backend, and GPU and CPU runs agree bit for bit with torch's cast of the same values.
  (The activation quantizers skip it where the GPU's own cast rounds: `hardware_fp8_cast`.)
The interpreter also truncates float32 -> bfloat16 instead of rounding; outputs stay within
an ulp, which the tests' tolerances absorb. Compiled (GPU) kernels may read only constexpr
globals, hence LOG2E and FP8_MAX_C.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PAGE_SIZE = 64
"""Tokens per KV page (batchgen.core.PAGE_SIZE; repeated so the kernels import standalone)."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; fp8 pools store value / (amax / FP8_MAX)."""
FP8_DTYPE = torch.float8_e4m3fn
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = tl.constexpr(1.4426950408889634)
"""log2(e): the online softmaxes run in base 2 (exp2 is the hardware instruction)."""
FP8_MAX_C = tl.constexpr(FP8_MAX)
"""FP8_MAX as a constexpr: jit code may only read constexpr globals."""
ACT_SCALE_FLOOR = 1e-12
"""Activation quantizers clamp a row's (or group's) amax here first (as
fp8.quantize_activations), so all-zero rows get a finite scale."""
ACT_SCALE_FLOOR_C = tl.constexpr(ACT_SCALE_FLOOR)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once: launchers size grids by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_device(*tensors: torch.Tensor | None) -> torch.device:
    """All given tensors share one device, which a kernel can run on; returns it."""
    present = [t for t in tensors if t is not None]
    device = present[0].device
    for t in present:
        if t.device != device:
            raise ValueError(f"tensors on {t.device} and {device}")
    if not (device.type == "cuda" or interpreting()):
        raise ValueError(f"{device} tensors need TRITON_INTERPRET=1 (the Triton CPU interpreter)")
    return device


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} not in {allowed}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if not (t.shape[-1] <= 1 or t.stride(-1) == 1):
        raise ValueError(f"{name}: last dim must have stride 1")


def check_output(name: str, out: torch.Tensor, shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
    """An output buffer given by the caller: this shape and dtype, last dim contiguous."""
    check_shape(name, out, shape)
    if out.dtype != dtype:
        raise TypeError(f"{name}: dtype {out.dtype}, expected {dtype}")
    if out.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous")


def check_kv_scales(kv: torch.Tensor, kv_scales: torch.Tensor | None,
                    shape: tuple[int, ...]) -> bool:
    """fp8 KV comes with float32 scales of `shape`, any other KV with none; whether it is
    fp8."""
    fp8 = kv.dtype == FP8_DTYPE
    if fp8 != (kv_scales is not None):
        raise ValueError("kv_scales must be given exactly for fp8 KV")
    if fp8:
        check_shape("kv_scales", kv_scales, shape)
        check_dtype("kv_scales", kv_scales, (torch.float32,))
    return fp8


def check_paged_kv(q: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor | None) -> bool:
    """Queries `q` [..., H, D] against one layer's K/V pages `kv` [num_pages, PAGE_SIZE, 2,
    KVH, D] (and fp8 scales [num_pages, PAGE_SIZE, 2, KVH]): dtypes, shapes, H a multiple of
    KVH, last dims contiguous. Whether the KV is fp8."""
    check_dtype("q", q, FLOAT_DTYPES)
    check_dtype("kv", kv, FLOAT_DTYPES + (FP8_DTYPE,))
    heads, head_dim = q.shape[-2:]
    num_pages, page, two, kv_heads, kv_dim = kv.shape
    if (page, two, kv_dim) != (PAGE_SIZE, 2, head_dim):
        raise ValueError(f"kv shape {tuple(kv.shape)}")
    if heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv", kv)
    return check_kv_scales(kv, kv_scales, (num_pages, PAGE_SIZE, 2, kv_heads))


def check_page_table(page_table: torch.Tensor, batch: int) -> None:
    """[batch, max_pages] int32 page ids, rows contiguous."""
    if not (page_table.dim() == 2 and page_table.shape[0] == batch):
        raise ValueError("page_table is [B, max_pages]")
    check_dtype("page_table", page_table, (torch.int32,))
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError("page_table rows must be contiguous")


def check_sinks_and_window(sinks: torch.Tensor | None, heads: int, window: int | None) -> None:
    """Per-head sink logits [heads] of a float dtype (or none), a window >= 1 (or none)."""
    if sinks is not None:
        check_shape("sinks", sinks, (heads,))
        check_dtype("sinks", sinks, FLOAT_DTYPES)
    if not (window is None or window >= 1):
        raise ValueError("window must be >= 1")


def use_f32_dot(dtype: torch.dtype) -> bool:
    """Whether attention dots must run on float32 operands (see the module docstring)."""
    return dtype == torch.float32 or interpreting()


_TL_FLOAT = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(q_dtype: torch.dtype, fp8_kv: bool) -> torch.dtype:
    """The dtype attention kernels cast q and K/V to for their two dots. fp8 KV goes to
    float16 when q is 16-bit: e4m3 -> f16 is one instruction per two values, e4m3 -> bf16
    takes a detour through f32 that made the fp8 kernels conversion-bound (no faster than
    bf16 on half the bytes). The e4m3 values (|v| <= 448) are exact in f16; q is cast too
    (bf16 q beyond f16's 65504 range does not occur in attention), probabilities times
    per-token V scales stay far above f16's subnormals where they matter, and both dots
    accumulate in float32."""
    if fp8_kv and q_dtype in (torch.float16, torch.bfloat16):
        return torch.float16
    return q_dtype


def tl_dot_dtype(q_dtype: torch.dtype, fp8_kv: bool):
    """`dot_dtype` as the Triton dtype a kernel's DOT_DTYPE constexpr takes."""
    return _TL_FLOAT[dot_dtype(q_dtype, fp8_kv)]


@triton.jit
def dot(a, b, F32: tl.constexpr):
    """a @ b with float32 accumulation; F32 upcasts the operands and uses IEEE precision."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def round_to_e4m3(y):
    """Round float32 `y` (|y| <= 448) to the nearest-even float8_e4m3fn value, kept in float32;
    NaN becomes 0, so fp8 pools never hold NaN (`load_page_kv` relies on it)."""
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # e4m3 has 3 mantissa bits and its smallest normal exponent is -6 (below: subnormal grid).
    ulp_exp = tl.maximum(exponent, -6) - 3
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    # Scaling by powers of two is exact; adding and removing 1.5 * 2^23 rounds a value below
    # 2^22 to an integer, ties to even.
    r = ((a * inv_ulp + 12582912.0) - 12582912.0) * ulp
    r = tl.minimum(r, 448.0)
    # Copy y's sign bit over (not `-r`: Triton lowers negation to 0 - r, which loses -0.0).
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31
    rounded = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(y == y, rounded, 0.0)  # noqa: PLR0124 (false only for NaN)


@triton.jit
def e4m3_scale(amax):
    """The per-row activation scale of a row whose largest |value| is `amax`: max(amax,
    floor) / 448, an IEEE division as the reference's."""
    return tl.math.div_rn(tl.maximum(amax, ACT_SCALE_FLOOR_C), FP8_MAX_C)


@triton.jit
def quantize_row_e4m3(y, HW_CAST: tl.constexpr):
    """One row `y` [N] float32 (masked-off elements 0) -> (y times the IEEE reciprocal of its
    scale, for the caller's cast to e4m3, and the scale `e4m3_scale`). One division per row
    instead of one per value: IEEE divisions and the rounding below made the fused
    quantizers instruction-bound (53 SASS instructions per value in SiLU-and-mul, 28 now).
    With HW_CAST the cast rounds to nearest even (`hardware_fp8_cast`); without, the values
    are rounded here onto the e4m3 grid, so the cast is exact."""
    scale = e4m3_scale(tl.max(tl.abs(y), axis=0))
    scaled = y * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if not HW_CAST:
        scaled = round_to_e4m3(scaled)
    return scaled, scale


@triton.jit
def kv_values_e4m3(x, scale, HW_CAST: tl.constexpr):
    """KV values `x` (float32) times the IEEE reciprocal of their row's `scale` (broadcast by
    the caller), ready for the cast to e4m3: rounded by the GPU's cast with HW_CAST (NaN
    turned into 0 here), else onto the e4m3 grid here (which maps NaN to 0 too). fp8 pools
    never hold NaN: the attention kernels read fp8 V unmasked (`load_page_kv`)."""
    y = x * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if HW_CAST:
        y = tl.where(y == y, y, 0.0)
    else:
        y = round_to_e4m3(y)
    return y


@functools.cache
def _native_fp8_cast(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def hardware_fp8_cast(device: torch.device) -> bool:
    """Whether Triton's cast to e4m3 is the GPU's round-to-nearest-even conversion
    (cvt.rn.satfinite, sm_89+), which matches torch's cast; the interpreter's does not (see
    above), so kernels round explicitly there (`round_to_e4m3`)."""
    if device.type != "cuda":
        return False
    return _native_fp8_cast(device.index if device.index is not None
                            else torch.cuda.current_device())


def fp8_v_stored(v: torch.Tensor) -> torch.Tensor:
    """The storage order of fp8 V blocks (`load_page_kv`): v [..., 64, D] (one page of one
    head, keys by dims) -> [..., 64, D] holding V transposed, i.e. the block's flat position
    d * 64 + key holds v[key, d]. A copy."""
    return v.transpose(-1, -2).reshape(v.shape)


def fp8_v_logical(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of `fp8_v_stored`: a stored block [..., 64, D] -> V [..., 64, D] (keys by dims)."""
    *lead, page, dim = stored.shape
    return stored.reshape(*lead, dim, page).transpose(-1, -2)


@triton.jit
def load_page_kv(kv_ptr, scale_ptr, kv_off, scale_off, offs_n, offs_d, mask_n, mask_d,
                 stride_slot, stride_kv, stride_scale_slot, stride_scale_kv,
                 DTYPE: tl.constexpr, FP8: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PAGE: tl.constexpr):
    """One page-block of one KV head: K^T [BLOCK_D, N] and V [N, BLOCK_D] cast to DTYPE, and
    the per-key dequantisation scales k_scale/v_scale [N] (ones unless FP8).

    `kv_off`/`scale_off` are the int64 element offsets of (page, slot 0, K, head). Keys
    outside `mask_n` get zero scales and (but for fp8 V) load as zero, so unwritten slots
    never reach the softmax or the PV product.

    fp8 pools store each page's V block transposed (`fp8_v_stored`): the PV product reduces
    over keys, and the tensor cores take 8-bit operands only with the reduced dim contiguous
    (a [keys, dims] fp8 tile is read from shared memory a byte per instruction, which made the
    fp8 kernel issue-bound). A key mask would split that load along keys into bytes again, so
    fp8 V loads whole pages: fp8 pools never hold NaN (they start zeroed and the stores write
    NaN as 0), so a masked key's stale V is finite and its zero probability times zero scale
    adds exactly nothing.
    """
    k_ptrs = kv_ptr + kv_off + offs_n[None, :] * stride_slot + offs_d[:, None]
    k_t = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0).to(DTYPE)
    v_base = kv_ptr + kv_off + stride_kv
    if FP8:
        if HEAD_DIM % PAGE == 0:  # key runs never cross a slot: offsets stay affine in keys
            per_slot: tl.constexpr = HEAD_DIM // PAGE
            v_ptrs = (v_base + ((offs_d // per_slot) * stride_slot
                                + (offs_d % per_slot) * PAGE)[None, :] + offs_n[:, None])
        else:
            flat = offs_d[None, :] * PAGE + offs_n[:, None]
            v_ptrs = v_base + (flat // HEAD_DIM) * stride_slot + flat % HEAD_DIM
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0).to(DTYPE)
        s_ptrs = scale_ptr + scale_off + offs_n * stride_scale_slot
        k_scale = tl.load(s_ptrs, mask=mask_n, other=0.0)
        v_scale = tl.load(s_ptrs + stride_scale_kv, mask=mask_n, other=0.0)
    else:
        v_ptrs = v_base + offs_n[:, None] * stride_slot + offs_d[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(DTYPE)
        k_scale = tl.full(offs_n.shape, 1.0, tl.float32)
        v_scale = k_scale
    return k_t, v, k_scale, v_scale


@triton.jit
def finish_softmax(m, l, acc, sink, HAS_SINK: tl.constexpr):
    """acc / l for an online softmax kept in base 2 (m row max, l row sum), where `sink`
    (already times log2(e)) is an extra logit that takes probability mass but adds no value."""
    if HAS_SINK:
        m_all = tl.maximum(m, sink)
        rescale = tl.exp2(m - m_all)
        l = l * rescale + tl.exp2(sink - m_all)
        acc = acc * rescale[:, None]
    l = tl.where(l > 0.0, l, 1.0)
    return acc / l[:, None]
