"""A launcher's broken precondition raises (ValueError, or TypeError for a dtype) and keeps
raising under `python -O`, where an assert would vanish and the kernel would read out of
bounds."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import torch
from batchgen_kernels import store_kv
k = torch.randn(2, 2, 32)
kv = torch.zeros(3, 64, 2, 4, 32)  # 4 KV heads, k has 2
fits = torch.zeros(3, 64, 2, 2, 32)
for name, call in (
        ("shape", lambda: store_kv(k, k, kv, None, torch.zeros(2, dtype=torch.int64))),
        ("dtype", lambda: store_kv(k, k, fits, None, torch.zeros(2, dtype=torch.float32)))):
    try:
        call()
    except (ValueError, TypeError) as err:
        print(name, type(err).__name__)
"""


def test_preconditions_raise_under_python_O():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-O", "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["shape ValueError", "dtype TypeError"], done.stdout
