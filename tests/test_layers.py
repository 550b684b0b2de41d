"""The import contracts in pyproject.toml ([tool.importlinter]) hold for the tree, and a crossed
layer breaks them: `lint-imports` (run by scripts/test.sh before the tests) must fail then."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports on `tree` (holding batchgen/ and batchgen_kernels/) with the project's
    contracts; only `tree` is on the path, so the copy is what gets analysed."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def _copy_tree(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "batchgen", dest / "batchgen", ignore=ignore)
    shutil.copytree(ROOT / "kernels" / "batchgen_kernels", dest / "batchgen_kernels", ignore=ignore)
    return dest


def test_the_tree_keeps_its_layers(tmp_path):
    done = _lint(_copy_tree(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("source, planted, contract", [
    ("models/llama.py", "import batchgen.engine.engine", "Models never import the engine"),
    ("models/base.py", "from batchgen.runner import exits", "Layers"),
    ("sched/pages.py", "import torch", "The scheduler knows pages and counts"),
    ("io/reader.py", "from batchgen.engine import structured", "io reads and writes files"),
    ("parallel.py", "from batchgen.runner.leader import launch", "Layers"),
    ("runner/worker/worker.py", "from batchgen.runner.leader import supervisor", "Runner roles"),
    ("runner/files/job.py", "from batchgen.runner.worker import outputs", "Runner roles"),
])
def test_a_crossed_layer_fails(tmp_path, source, planted, contract):
    tree = _copy_tree(tmp_path)
    module = tree / "batchgen" / source
    module.write_text(module.read_text() + f"\n{planted}  # planted by the test\n")
    done = _lint(tree)
    assert done.returncode != 0
    broken = [line for line in done.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), done.stdout


def test_running_from_the_repository_root_shadows_no_installed_package():
    """`python -m batchgen` and `python -c` put the working directory first on sys.path: a package
    folder at the repository root named like an installed one (a kernels/ package against the
    Hub's `kernels`, which transformers imports) would shadow it there."""
    assert {init.parent.name for init in ROOT.glob("*/__init__.py")} == {"batchgen"}
    code = "import transformers.activations, batchgen_kernels; print(batchgen_kernels.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).parent == ROOT / "kernels" / "batchgen_kernels"
