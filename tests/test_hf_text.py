"""transformers is imported for text models only: its image and video helpers' torchvision
import and its generation utilities' scikit-learn import (seconds of start-up on machines that
have them) never run."""

import importlib.util
import subprocess
import sys

import pytest

LOAD = ("from transformers import AutoConfig; AutoConfig.for_model('llama'); "
        "import sys; print('torchvision' in sys.modules)")


SKLEARN = ("import transformers.utils as u; print(u.is_sklearn_available()); "
           "import transformers.generation.candidate_generator, sys; "
           "print('sklearn' in sys.modules)")


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that finds torchvision and scikit-learn installed (fakes
    that raise when imported)."""
    for package, dist in (("torchvision", "torchvision-0.99.0"), ("sklearn", "scikit_learn-9.9.0")):
        fake = tmp_path / package
        fake.mkdir(exist_ok=True)
        (fake / "__init__.py").write_text(f"raise RuntimeError('{package} imported')\n")
        info = tmp_path / f"{dist}.dist-info"
        info.mkdir(exist_ok=True)
        name, version = dist.rsplit("-", 1)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                       f"Version: {version}\n")
    env = {"PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("PIL") is None,
                    reason="transformers imports torchvision only where PIL is installed")
def test_a_config_loads_without_importing_torchvision(tmp_path):
    done = _run("from batchgen.models.hf_text import text_only; text_only(); " + LOAD, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


@pytest.mark.skipif(importlib.util.find_spec("PIL") is None,
                    reason="transformers imports torchvision only where PIL is installed")
def test_without_it_transformers_would_import_torchvision(tmp_path):
    done = _run(LOAD, tmp_path)  # the fake torchvision raises when imported
    assert done.returncode != 0 and "torchvision imported" in done.stderr


def test_generation_utilities_load_without_importing_sklearn(tmp_path):
    done = _run("from batchgen.models.hf_text import text_only; text_only(); " + SKLEARN,
                tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]


def test_without_it_transformers_would_see_sklearn(tmp_path):
    done = _run("import transformers.utils as u; print(u.is_sklearn_available())", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]  # the check text_only answers says it is there
