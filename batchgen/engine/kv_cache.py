"""KV storage: pools of 64-token pages, laid out page-major on the device and in the host tier.

Layout of a pool: `data[num_pages, num_layers, PAGE_SIZE, *token_shape]`. One page holds every
layer's KV for 64 tokens in one contiguous block, so moving a page between tiers is one large
copy (per-layer 32 KiB copies run ~22x slower than MiB-sized ones: docs/architecture.md,
"Measured transfer costs").
`token_shape` comes from the model: (2, kv_heads, head_dim) for K and V of GQA attention,
(1, latent + rope dims) for DeepSeek's MLA. fp8 pools keep one float32 scale per token and
leading index (per token and head for GQA). They are stored page-major too, with the page's 64
slots innermost (`scale_pages[num_pages, num_layers, *token_shape[:-1], PAGE_SIZE]`), so the
decode kernel reads a page's scales of one head as 256 contiguous bytes instead of 64 strided
4-byte loads (a 32-byte memory sector each); `scales` is the same memory seen in the data's
index order, `[num_pages, num_layers, PAGE_SIZE, *token_shape[:-1]]`, which the kernels take
by strides. fp8 GQA pools also store each (page, layer, head) block of V transposed: its flat
position d * 64 + key holds V[key, d], so the decode kernel reads V along keys, the only order
in which the tensor cores take 8-bit operands for the PV product (batchgen_kernels'
`load_page_kv`). K, scales and every other pool keep token order. fp8 pools never hold NaN:
they start zeroed (the host segment is fresh memory) and every store writes NaN as 0, because
the kernels read whole V pages, a masked key's stale V included (times an exact zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from batchgen.core import PAGE_SIZE

FP8_MAX = 448.0

KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
             "fp8_e4m3fn": torch.float8_e4m3fn}
"""KV storage dtypes by --kv-dtype name (besides "auto")."""


@dataclass(frozen=True)
class KVLayout:
    """What one token's KV looks like in one layer, and how it is stored."""

    num_layers: int
    token_shape: tuple[int, ...]
    dtype: torch.dtype
    """Storage dtype (torch.float8_e4m3fn for fp8 pools)."""
    compute_dtype: torch.dtype
    """Dtype attention reads KV back as."""

    @classmethod
    def of_model(cls, model: torch.nn.Module, kv_dtype: str = "auto") -> KVLayout:
        """`model`'s layout with KV stored as `kv_dtype` ("auto": the model's dtype, or one
        of KV_DTYPES)."""
        model_dtype = next(model.parameters()).dtype
        return cls(model.config.num_hidden_layers, tuple(model.kv_token_shape),
                   model_dtype if kv_dtype == "auto" else KV_DTYPES[kv_dtype], model_dtype)

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def transposed_v(self) -> bool:
        """Whether V blocks are stored transposed (fp8 GQA pools: module docstring)."""
        return self.quantized and len(self.token_shape) == 3 and self.token_shape[0] == 2

    @property
    def values_per_token(self) -> int:
        """KV values per token in one layer."""
        return math.prod(self.token_shape)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV per token across all layers (scales included)."""
        values = self.values_per_token
        per_layer = values * self.dtype.itemsize
        if self.quantized:
            per_layer += (values // self.token_shape[-1]) * 4
        return per_layer * self.num_layers

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * PAGE_SIZE

    def pages_for_bytes(self, num_bytes: float) -> int:
        return int(num_bytes // self.bytes_per_page)

    def scale_pages_shape(self, num_pages: int) -> tuple[int, ...]:
        """Storage shape of an fp8 pool's scales: slots innermost (module docstring)."""
        return (num_pages, self.num_layers, *self.token_shape[:-1], PAGE_SIZE)


class KVPool:
    """A tier of KV pages (device or host). Owns tensors, knows nothing about sequences."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str,
                 data: torch.Tensor | None = None, scale_pages: torch.Tensor | None = None):
        """`data` / `scale_pages`: storage to use (the host segment), else allocated here."""
        self.layout = layout
        self.num_pages = num_pages
        shape = (num_pages, layout.num_layers, PAGE_SIZE, *layout.token_shape)
        if data is None:
            data = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.data = data
        assert tuple(self.data.shape) == shape and self.data.is_contiguous(), tuple(self.data.shape)
        self.scale_pages = scale_pages
        self.scales = None
        if layout.quantized:
            if scale_pages is None:
                self.scale_pages = torch.ones(layout.scale_pages_shape(num_pages),
                                              dtype=torch.float32, device=device)
            assert (tuple(self.scale_pages.shape) == layout.scale_pages_shape(num_pages)
                    and self.scale_pages.is_contiguous()), tuple(self.scale_pages.shape)
            self.scales = self.scale_pages.movedim(-1, 2)
        self._scratch: torch.Tensor | None = None
        """Reused output of `gather_heads` (see there)."""

    @property
    def device(self) -> torch.device:
        return self.data.device

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views `[num_pages, PAGE_SIZE, *token_shape]` (and scales) of one layer."""
        scales = self.scales[:, layer] if self.scales is not None else None
        return self.data[:, layer], scales

    def store(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write `kv[T, *token_shape]` at flat slots (page * PAGE_SIZE + offset)."""
        data, scales = self.layer(layer)
        # Slot -1: a row with nothing to store (the kernels skip it too). Not checked on CUDA,
        # where reading the minimum would sync; the Triton stores handle it there.
        if not slots.is_cuda and slots.numel() and int(slots.min()) < 0:
            keep = slots >= 0
            slots, kv = slots[keep], kv[keep]
        # The layer view is strided over pages, so index (page, offset) instead of a flat slot.
        page, offset = slots // PAGE_SIZE, slots % PAGE_SIZE
        if self.layout.quantized:
            amax = kv.float().abs().amax(dim=-1).clamp_min(1e-8)
            # tensor / tensor: IEEE on CUDA too, where a Python divisor becomes a reciprocal
            # multiply (an ulp off the kernels' store at times).
            scale = amax / torch.full_like(amax, FP8_MAX)
            inverse = torch.ones_like(scale) / scale  # one division per row, as the kernel
            # NaN is stored as 0: the GPU kernels read fp8 V unmasked (module docstring).
            values = torch.nan_to_num(kv.float() * inverse.unsqueeze(-1), nan=0.0).to(
                self.layout.dtype)
            scales[page, offset] = scale
            if not self.layout.transposed_v:
                data[page, offset] = values
                return
            data[page, offset, 0] = values[:, 0]
            # V[offset, d] sits at flat position d * 64 + offset of its page's block.
            heads, dim = values.shape[-2:]
            flat = torch.arange(dim, device=slots.device) * PAGE_SIZE + offset[:, None]
            head = torch.arange(heads, device=slots.device)[None, :, None]
            data[page[:, None, None], (flat // dim)[:, None], 1, head,
                 (flat % dim)[:, None]] = values[:, 1]
        else:
            data[page, offset] = kv.to(self.layout.dtype)

    def gather(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """KV of `pages[..., P]` as `[..., P * PAGE_SIZE, *token_shape]` in the compute dtype."""
        lead = pages.shape[:-1]
        picked = self._rows(self.data, layer, pages.reshape(-1), 0)
        if self.layout.transposed_v:  # [N, 64, 2, KVH, D]: V back in token order
            picked[:, :, 1] = v_logical(picked[:, :, 1].movedim(1, 2)).movedim(2, 1)
        picked = picked.reshape(*lead, -1, *self.layout.token_shape)
        if not self.layout.quantized:
            return picked.to(self.layout.compute_dtype)
        scale = self._rows(self.scales, layer, pages.reshape(-1), 0)
        scale = scale.reshape(*lead, -1, *self.layout.token_shape[:-1])
        return (picked.float() * scale.unsqueeze(-1)).to(self.layout.compute_dtype)

    def gather_heads(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """KV of `pages[N]` with the token's leading dims first, in the compute dtype:
        `[*token_shape[:-1], N, PAGE_SIZE, token_shape[-1]]`, i.e. `[2, KVH, N, 64, D]` for GQA.

        Every (K or V, head) page is then one contiguous `[64, D]` block, the layout CPU
        batched matmuls need (on strided pages they run several times slower). The result
        may be a view of a scratch buffer that the next call overwrites: on CPU a fresh
        multi-MiB tensor per layer costs about as much in page faults as the copy itself.
        """
        lead = len(self.layout.token_shape) - 1
        if self.layout.quantized or self.layout.dtype != self.layout.compute_dtype:
            picked = self._rows(self.data, layer, pages, lead)
            if self.layout.transposed_v:  # [2, KVH, N, 64, D]: V back in token order
                picked[1] = v_logical(picked[1])
            if not self.layout.quantized:
                return picked.to(self.layout.compute_dtype)
            scale = self._rows(self.scales, layer, pages, lead)
            return (picked.float() * scale.unsqueeze(-1)).to(self.layout.compute_dtype)
        token_shape = self.layout.token_shape
        shape = (*token_shape[:-1], pages.numel(), PAGE_SIZE, token_shape[-1])
        numel = math.prod(shape)
        if self._scratch is None or self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=self.layout.dtype, device=self.device)
        out = self._scratch[:numel].view(shape)
        return self._rows(self.data, layer, pages, lead, out=out)

    def _rows(self, source: torch.Tensor, layer: int, pages: torch.Tensor, lead: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """`source[pages, layer]` (source is `data` or `scales`) as one index_select over the
        flattened (page, layer) rows, with the first `lead` token dims moved in front.

        One index_select of whole rows is several times faster on CPU than advanced indexing
        of the strided per-layer view."""
        flat = source.flatten(0, 1)  # a view: pages and layers are the outer storage dims
        rows = pages.long() * self.layout.num_layers + layer
        if lead:
            flat = flat.movedim(tuple(range(2, 2 + lead)), tuple(range(lead)))
        if out is None:
            return flat.index_select(lead, rows)
        return torch.index_select(flat, lead, rows, out=out)


def v_logical(stored: torch.Tensor) -> torch.Tensor:
    """Stored fp8 V blocks [..., 64, D] (flat position d * 64 + key holds V[key, d]) -> a
    new tensor V [..., 64, D] in token order; batchgen_kernels' `fp8_v_logical`, restated so
    the engine's CPU path imports no Triton."""
    *lead, page, dim = stored.shape
    return stored.reshape(*lead, dim, page).transpose(-1, -2).contiguous()


def copy_pages(src: KVPool, dst: KVPool, runs: list[tuple[int, int, int]]) -> None:
    """Copy whole pages between tiers (or within the device pool: forks), one slice copy per
    run of consecutive pages (`page_runs`: first source page, first destination page, count).

    A page is one contiguous block of every layer (8.4 MB for Llama-3-8B in bf16), so each run
    is one large DMA between the device and the host pool, at full PCIe speed where its chunk
    is pinned (engine/host_pin.py; a chunk not pinned yet copies pageable, ~6 GB/s), with no
    gather/scatter through temporaries. On CUDA the copies are asynchronous on the compute
    stream, which orders them after the kernels that wrote their source pages and before any
    kernel that reads or overwrites their destination pages (a page freed by an unload may be
    refilled in the same step). Nothing on the host reads the host pool, and every step that
    runs a forward ends by reading its sampled tokens, which waits for the stream;
    `ModelRunner.close` synchronises before the segment is unregistered."""
    asynchronous = src.device.type == "cuda" or dst.device.type == "cuda"
    for src_first, dst_first, count in runs:
        source, target = slice(src_first, src_first + count), slice(dst_first, dst_first + count)
        dst.data[target].copy_(src.data[source], non_blocking=asynchronous)
        if src.scale_pages is not None:
            dst.scale_pages[target].copy_(src.scale_pages[source], non_blocking=asynchronous)


def page_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, count) of each maximal run in which both
    page lists step by one, in order."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destinations")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
