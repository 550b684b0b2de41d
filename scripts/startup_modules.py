"""Write batchgen/startup_modules.txt: the source files a batchgen start imports, in order.

    python scripts/startup_modules.py

Runs a tiny `batchgen bench` on the CPU in this process, loads the embedded default model with
its tokenizer and chat template as a `batchgen run` worker does, then imports what the GPU path
and other models import besides (the supervisor and worker modules, transformers' configs of the
families batchgen serves, Triton and xgrammar where installed),
and lists every module loaded from a `.py` file outside Python's standard library, as
`package/relative/path.py` (or `module.py`), in the order they were imported, then the other
modules beside transformers' listed ones (its versions move imports between neighbouring
modules: a GPU image's transformers finds more of its own compiled ahead). batchgen/bytecode.py
compiles that list ahead of the imports where an install ships no bytecode. Rerun it after
changing what batchgen imports at start-up; a stale list only compiles less ahead.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "batchgen" / "startup_modules.txt"
CONFIG_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "deepseek_v3", "gpt_oss")
NEIGHBOURS_OF = ("transformers",)
"""Packages whose listed modules bring every other module of their folders into the list."""
ALSO_IMPORTED = ("batchgen.runner.leader.supervisor", "batchgen.runner.worker.serve",
                 "batchgen.engine.precompile", "transformers.tokenization_utils_fast",
                 "transformers.generation", "safetensors.torch", "triton", "triton.language",
                 "xgrammar", "batchgen_kernels")


def run_tiny_bench() -> None:
    from batchgen.__main__ import main

    sys.argv = ["batchgen", "bench", "--tiny", "--device", "cpu", "--requests", "4",
                "--input-len", "16", "--output-len", "4"]
    try:
        main()
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise


def load_the_default_model() -> None:
    import torch

    from batchgen.config import ModelConfig
    from batchgen.models.factory import load_model

    loaded = load_model(ModelConfig(), torch.device("cpu"))
    loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)


def import_the_rest() -> None:
    from transformers import AutoConfig

    for family in CONFIG_FAMILIES:
        AutoConfig.for_model(family)
    for name in ALSO_IMPORTED:
        try:
            importlib.import_module(name)
        except ImportError:
            print(f"not installed here: {name}")


def entry(name: str, module) -> str | None:
    """`package/relative/path.py` or `module.py` for a module loaded from a .py file outside
    the standard library, else None."""
    top = name.partition(".")[0]
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    if top in sys.stdlib_module_names or not origin or not origin.endswith(".py"):
        return None
    if "." not in name and not hasattr(module, "__path__"):
        return f"{name}.py"
    root = getattr(sys.modules.get(top), "__path__", None)
    if not root:
        return None
    relative = os.path.relpath(origin, list(root)[0])
    return None if relative.startswith("..") else f"{top}/{relative}"


def neighbours(lines: list[str]) -> list[str]:
    """The .py files beside the listed ones of NEIGHBOURS_OF's packages, not listed yet."""
    listed, found = set(lines), []
    for top in NEIGHBOURS_OF:
        root = Path(list(sys.modules[top].__path__)[0])
        folders = sorted({Path(line).parent.relative_to(top) for line in lines
                          if line.startswith(f"{top}/")})
        for folder in folders:
            for path in sorted((root / folder).glob("*.py")):
                line = f"{top}/{path.relative_to(root).as_posix()}"
                if line not in listed:
                    listed.add(line)
                    found.append(line)
    return found


def main() -> None:
    run_tiny_bench()
    load_the_default_model()
    import_the_rest()
    lines, seen = [], set()
    for name, module in list(sys.modules.items()):
        line = entry(name, module)
        if line and line not in seen and line != "batchgen/bytecode.py":
            seen.add(line)
            lines.append(line)
    imported = len(lines)
    lines += neighbours(lines)
    header = ("# Source files a batchgen start imports, in import order (batchgen/bytecode.py).\n"
              "# Written by `python scripts/startup_modules.py`; rerun it to refresh.\n")
    OUT.write_text(header + "\n".join(lines) + "\n")
    print(f"{imported} imported + {len(lines) - imported} beside them -> {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
