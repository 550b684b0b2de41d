import os
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
