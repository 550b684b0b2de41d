"""Time one gpt-oss-20b MoE layer's experts on a CUDA device (H200 intended).

Usage: python benchmarks/gpt_oss_moe_bench.py [--tokens 1,16,64,256,2048] [--no-loop]

Shapes: hidden 2880, intermediate 2880, 32 experts, 4 per token, random MXFP4 weights and
routing. Rows, per token count T (M = 4T expert rows):
- loop:         GptOssExperts.forward_loop, the per-expert reference (host syncs);
- grouped:      forward (sorted rows, one dequantize of each packed bank, two grouped GEMMs);
- grouped+dq:   the same with pre-dequantized bf16 weights (--pre-dequantize-weights);
- *graph:       the grouped rows replayed from a CUDA graph (fails loudly if it cannot capture).
Columns: median ms (triton.testing.do_bench) and the relative L2 difference to the loop.
Needs ~6 GB of GPU memory. Not a test.
"""

from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

import torch
from triton.testing import do_bench

from batchgen.models.gpt_oss import GptOssExperts

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4


@torch.no_grad()
def build(packed: bool) -> GptOssExperts:
    cfg = SimpleNamespace(num_local_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER)
    experts = GptOssExperts(cfg, packed=True).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for proj in (experts.gate_up_proj, experts.down_proj):
        proj.blocks.copy_(torch.randint(0, 256, proj.blocks.shape, device="cuda",
                                        dtype=torch.uint8, generator=gen))
        proj.scales.fill_(127 - 6)  # values up to 6/64: activations stay O(1)
    experts.gate_up_proj_bias.normal_(0, 0.1, generator=gen)
    experts.down_proj_bias.normal_(0, 0.1, generator=gen)
    if not packed:
        for proj in (experts.gate_up_proj, experts.down_proj):
            dense = proj.bank(torch.bfloat16)
            del proj.blocks, proj.scales
            proj.weight = torch.nn.Parameter(dense, requires_grad=False)
    return experts


def routing(tokens: int):
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    top, ids = torch.topk(logits, TOP_K, dim=-1)
    return torch.softmax(top, dim=-1).to(torch.bfloat16), ids


def graphed(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256,2048")
    parser.add_argument("--no-loop", action="store_true", help="skip the slow reference loop")
    args = parser.parse_args()
    banks = {"grouped": build(packed=True), "grouped+dq": build(packed=False)}
    print(f"{'T':>6} {'row':>16} {'ms':>9} {'rel diff':>9}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        bench_tokens(tokens, banks, not args.no_loop)


@torch.inference_mode()
def bench_tokens(tokens: int, banks: dict[str, GptOssExperts], with_loop: bool) -> None:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(tokens)
    reference = None
    if with_loop:
        loop = functools.partial(banks["grouped"].forward_loop, x, weights, ids)
        reference = loop()
        print(f"{tokens:>6} {'loop':>16} {do_bench(loop):>9.3f}")
    for name, experts in banks.items():
        run = functools.partial(experts, x, weights, ids)
        diff = f"{rel(run(), reference):>9.1e}" if reference is not None else ""
        print(f"{tokens:>6} {name:>16} {do_bench(run):>9.3f} {diff}")
        print(f"{tokens:>6} {name + ' graph':>16} {do_bench(graphed(run)):>9.3f}")

if __name__ == "__main__":
    main()
