"""transformers is imported for text models only: its image and video helpers' torchvision
import (seconds of start-up on machines with torchvision) never runs."""

import subprocess
import sys

import pytest

pytest.importorskip("PIL", reason="transformers imports torchvision only where PIL is installed")

LOAD = ("from transformers import AutoConfig; AutoConfig.for_model('llama'); "
        "import sys; print('torchvision' in sys.modules)")


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('torchvision imported')\n")
    env = {"PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_a_config_loads_without_importing_torchvision(tmp_path):
    done = _run("from batchgen.models.hf_text import text_only; text_only(); " + LOAD, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_without_it_transformers_would_import_torchvision(tmp_path):
    done = _run(LOAD, tmp_path)  # the fake torchvision raises when imported
    assert done.returncode != 0 and "torchvision imported" in done.stderr
