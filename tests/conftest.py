import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# batchgen and batchgen_kernels are installed (editable); only this folder goes on sys.path,
# for the tests' shared helper modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One intra-op thread: tiny test matmuls gain nothing from two, and OpenMP spin-waits make them
# ~20x slower whenever the other core is busy (a subprocess under test, the CI runner).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    from tiny_models import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture
def template_tokenizer():
    """The embedded model's tokenizer, its chat template put back after the test."""
    from tiny_models import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    original = tokenizer.chat_template
    yield tokenizer
    tokenizer.chat_template = original


@pytest.fixture
def repo_folder(tiny_chat_model, tmp_path):
    """The tiny chat model as a Hub repo holds it, pickled files beside its safetensors."""
    folder = tmp_path / "repo"
    shutil.copytree(tiny_chat_model, folder)
    (folder / "pytorch_model.bin").write_bytes(b"pickle, never fetched")
    (folder / "training_args.pt").write_bytes(b"pickle")
    return folder


@pytest.fixture
def fake_hub(repo_folder, monkeypatch):
    """A Hub on loopback (fake_hub.py) serving `repo_folder` as org/tiny, HF_ENDPOINT at it."""
    import huggingface_hub.constants
    from fake_hub import FakeHub

    server = FakeHub()
    server.add("org/tiny", repo_folder)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    # huggingface_hub reads HF_HUB_OFFLINE once, at import (set above for every test).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.close()
