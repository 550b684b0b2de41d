"""Kernel tests run the Triton kernels through the CPU interpreter when there is no GPU.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, so it is set here, before any
test module imports batchgen_kernels. Shared helpers live in kernel_testing.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs each run; the seed is printed so a failure can be replayed with
    KERNEL_TEST_SEED=<seed>."""
    seed = int(os.environ.get("KERNEL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    return seed
