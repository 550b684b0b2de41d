"""What compiling the imports costs a start where no bytecode is cached, and what
batchgen/bytecode.py's compiler wins back.

    python benchmarks/bytecode_start.py [--workers N] [--repeats 2]

Each row is a fresh interpreter with PYTHONDONTWRITEBYTECODE=1 whose bytecode cache is a
directory of its own (`sys.pycache_prefix`), so bytecode shipped beside the sources is not used,
importing what a `bench` start imports before its first model work (torch, transformers' Llama
config as batchgen loads it, `batchgen.bench`):

- `compiled by the import`: an empty cache, nothing compiled ahead: what every start costs on
  an install without bytecode where Python may not write it;
- `with the compiler`: an empty cache, with `python -m batchgen.bytecode` compiling
  batchgen/startup_modules.txt beside the import (`--workers` processes), as `run` and
  `bench` start it there;
- `cache filled`: the same directory again, now holding what the row before compiled.

Prints the seconds of each (the best of `--repeats`, each on a new empty cache).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchgen.bytecode import MANIFEST, compiler_command, default_workers

REPO = Path(__file__).resolve().parent.parent
IMPORTS = ("import torch; from batchgen.models.hf_text import text_only; text_only(); "
           "import transformers.models.llama.configuration_llama; import batchgen.bench")


def timed_import(cache: Path, compiler_workers: int | None) -> float:
    """Seconds of one fresh interpreter's imports with `cache` as its bytecode cache; with
    `compiler_workers`, batchgen's compiler runs beside it (its start included)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(cache),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    compiler = None
    if compiler_workers:
        compiler = subprocess.Popen(compiler_command(cache, MANIFEST, compiler_workers), env=env)
    # The importer may write into the cache too, as a start under bytecode.py does.
    code = "import sys; sys.dont_write_bytecode = False; " + IMPORTS
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    seconds = time.perf_counter() - start
    if compiler is not None:
        compiler.wait()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="the compiler's processes (default: as `run` starts it)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    plural = "s" if args.workers > 1 else ""
    rows = {"compiled by the import": [], f"with the compiler ({args.workers} worker{plural})": [],
            "cache filled": []}
    names = list(rows)
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="batchgen-bytecode-") as bare, \
                tempfile.TemporaryDirectory(prefix="batchgen-bytecode-") as ahead:
            # The first row's cache is thrown away: the next row starts from empty again.
            rows[names[0]].append(timed_import(Path(bare), None))
            rows[names[1]].append(timed_import(Path(ahead), args.workers))
            rows[names[2]].append(timed_import(Path(ahead), None))
    print(f"{'start (torch + Llama config + batchgen.bench)':48s} {'seconds':>8s}")
    for name, seconds in rows.items():
        print(f"{name:48s} {min(seconds):8.2f}")


if __name__ == "__main__":
    main()
