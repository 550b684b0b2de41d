"""Compile the paged decode kernel for an H100/H200 (sm_90) on a machine without a GPU and
print what its SASS costs: registers, spill (stack) bytes, shared memory, and the instruction
mix of the page loop. No GPU is needed; this answers "does the variant spill", "how many
instructions per page" and "does the V tile reach the tensor cores through ldmatrix".

    python benchmarks/sass_report.py [--warps 2 4] [--stages 2 3]
    python benchmarks/sass_report.py --quantizers

It uses the installed Triton and the cuobjdump that ships inside it. Counts depend on the
Triton version: to see exactly what a GPU machine compiles, run it in an environment with
that machine's Triton (e.g. `pip install triton==3.6.0`).

The compile reproduces a launch's specialisation (pointers and ints divisible by 16, ints
equal to 1 folded), so the numbers match the GPU's: `ncu` on an H200 reports the same
registers and shared memory for the same kernel and Triton version. Counts are SASS
instructions per thread; a loop body is the span a backward branch jumps over.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
import triton.language as tl
from batchgen_kernels import decode_attention as DA
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
"""Llama-3-8B's KV shape, as one layer's view of the engine's pool."""
OPS = ("HMMA", "LDSM", "LDS", "STS", "LDGSTS", "LDG", "F2FP", "IMAD", "FMUL", "MUFU", "BAR")


def decode_launch(fp8: bool) -> tuple[dict, dict]:
    """The decode kernel's runtime arguments (pointer types or int values) and constexprs for
    a bf16 query over one layer of a Llama-3-8B pool, one split, no window or sinks."""
    args = {
        "q_ptr": "*bf16", "kv_ptr": "*fp8e4nv" if fp8 else "*bf16", "scale_ptr": "*fp32",
        "page_table_ptr": "*i32", "context_lens_ptr": "*i32", "sinks_ptr": "*bf16",
        "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
        "sm_scale": "fp32", "window": 0, "pages_per_split": "i32", "num_splits": "i32",
        "stride_pt": "i32", "stride_qt": 32 * HEAD_DIM, "stride_qh": HEAD_DIM,
        "stride_ot": 32 * HEAD_DIM, "stride_oh": HEAD_DIM,
        "stride_page": LAYERS * 64 * 2 * KV_HEADS * HEAD_DIM,
        "stride_slot": 2 * KV_HEADS * HEAD_DIM, "stride_kv": KV_HEADS * HEAD_DIM,
        "stride_head": HEAD_DIM,
        "stride_s_page": LAYERS * 2 * KV_HEADS * 64 if fp8 else 0,
        "stride_s_slot": 1 if fp8 else 0, "stride_s_kv": KV_HEADS * 64 if fp8 else 0,
        "stride_s_head": 64 if fp8 else 0,
    }
    consts = {
        "GROUP": 4, "HEAD_DIM": HEAD_DIM, "BLOCK_G": 16, "BLOCK_D": HEAD_DIM, "PAGE": 64,
        "SPLIT": False, "HAS_WINDOW": False, "HAS_SINKS": False, "FP8": fp8,
        "DOT_DTYPE": tl.float16 if fp8 else tl.bfloat16, "F32_DOT": False,
    }
    return args, consts


def compile_sm90(kernel, args: dict, consts: dict, warps: int, stages: int):
    """triton.compile for sm_90 with the specialisation a launch with these values gets. In
    `args` a string is a type (pointers get divisibility 16), an int a value."""
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = consts.get(name, args.get(name))
        if name in consts or value == 1:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, str):
            signature[name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def loop_bodies(sass: str) -> list[Counter]:
    """Opcode counts of each span a backward branch closes."""
    code = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {address: i for i, (address, _) in enumerate(code)}
    bodies = []
    for i, (address, text) in enumerate(code):
        branch = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        target = int(branch[1], 16) if branch else None
        if target is not None and target < address and target in index:
            words = (t.split() for _, t in code[index[target]:i + 1])
            bodies.append(Counter((w[1] if w[0].startswith("@") else w[0]).split(".")[0]
                                  for w in words))
    return bodies


def report(fp8: bool, warps: int, stages: int) -> str:
    compiled = compile_sm90(DA._decode_kernel, *decode_launch(fp8), warps, stages)
    usage = cuobjdump(compiled.asm["cubin"], "--dump-resource-usage")
    regs = re.search(r"REG:(\d+)", usage)[1]
    stack = re.search(r"STACK:(\d+)", usage)[1]
    # The page loops (edge pages masked, then full pages unmasked, then the tail page): the
    # loops that reach the tensor cores, in code order.
    bodies = [b for b in loop_bodies(cuobjdump(compiled.asm["cubin"], "-sass")) if b["HMMA"]]
    kv = "fp8 " if fp8 else "bf16"
    lines = [f"{kv} w={warps} s={stages}  regs={regs:>3} stack={stack:>4} "
             f"shared={compiled.metadata.shared:>6}"]
    for body in bodies:
        mix = " ".join(f"{op}={body[op]}" for op in OPS if body[op])
        lines.append(f"    loop={sum(body.values()):>5}  {mix}")
    return "\n".join(lines)


def quantizer_launches() -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, args, constexprs, values per program) of the per-row e4m3 quantizers at
    Llama-3-8B widths (bf16 in: hidden 4096, SiLU-and-mul over 2 x 14336)."""
    import importlib

    def module(name):  # the package re-exports functions under the modules' names
        return importlib.import_module(f"batchgen_kernels.{name}")

    hidden = {"n_cols": 4096, "stride_x": 4096}
    return [
        ("silu_and_mul_fp8", module("silu_mul")._silu_mul_fp8_kernel,
         {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "n_cols": 14336,
          "stride_x": 28672, "stride_q": 14336}, {"BLOCK": 16384}, 16384),
        ("fused_add_rmsnorm_fp8", module("rmsnorm")._rmsnorm_kernel,
         {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16",
          "out_ptr": "*fp8e4nv", "residual_out_ptr": "*bf16", "scale_ptr": "*fp32",
          "eps": "fp32", **hidden, "stride_r": 4096, "stride_o": 4096, "stride_ro": 4096},
         {"BLOCK": 4096, "HAS_RESIDUAL": True, "FP8_OUT": True}, 4096),
        ("quantize_fp8_rows", module("fp8_rows")._quantize_rows_kernel,
         {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", **hidden,
          "stride_q": 4096}, {"BLOCK": 4096}, 4096),
    ]


def quantizer_report() -> str:
    """SASS instructions per quantized value, with the GPU's cast rounding (HW_CAST, what
    sm_89+ runs) and with the explicit rounding the interpreter needs."""
    from batchgen_kernels.fp8_rows import row_warps

    lines = []
    for name, kernel, args, consts, values in quantizer_launches():
        warps = row_warps(consts["BLOCK"])
        for hw_cast in (True, False):
            compiled = compile_sm90(kernel, args, {**consts, "HW_CAST": hw_cast}, warps, 1)
            sass = cuobjdump(compiled.asm["cubin"], "-sass")
            count = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[^;]*;", sass))
            lines.append(f"{name:22} HW_CAST={hw_cast!s:5} warps={warps:2} "
                         f"{count * warps * 32 / values:5.1f} instructions per value")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    parser.add_argument("--quantizers", action="store_true",
                        help="Report the per-row e4m3 quantizers instead of the decode kernel.")
    args = parser.parse_args()
    if args.quantizers:
        print(quantizer_report())
        return
    for fp8 in (True, False):
        for warps in args.warps:
            for stages in args.stages:
                print(report(fp8, warps, stages), flush=True)


if __name__ == "__main__":
    main()
