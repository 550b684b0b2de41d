"""transformers imported for text models only.

Wherever PIL and torchvision are both installed (most GPU machines), transformers' configuration
modules import its image and video helpers, which import torchvision, which imports every
torchvision model and, through its detection ops, torch's compiler stack: ~3.5 s of a worker's
start-up on an H200 machine, for argument checks of image and video processors that a text
model never has. Wherever scikit-learn is installed, some transformers versions import
`sklearn.metrics` (and through it scipy and pandas) from the generation utilities that every
Auto class loads, for assisted decoding's confidence threshold: 1.6 s of an H100 machine's
start even with compiled bytecode. `text_only()` tells transformers both are absent before
those modules load; tokenizers, configs and models are unaffected.
"""

from __future__ import annotations

import importlib
import sys

SKIPPED_IMPORTS = {
    "is_torchvision_available": ("transformers.image_utils", "transformers.video_utils"),
    "is_sklearn_available": ("transformers.generation.candidate_generator",),
}
"""transformers' availability checks that `text_only` answers False, each with the modules
that read it when they load (once they are loaded, changing the check changes nothing)."""


def text_only() -> None:
    """Make transformers skip its torchvision and scikit-learn imports (a no-op for a check
    whose readers are loaded, or where transformers has no such check)."""
    try:
        modules = [importlib.import_module("transformers.utils.import_utils"),
                   importlib.import_module("transformers.utils")]
    except ImportError:
        return
    for check, readers in SKIPPED_IMPORTS.items():
        if any(name in sys.modules for name in readers):
            continue
        for module in modules:
            if hasattr(module, check):
                setattr(module, check, _absent)


def _absent() -> bool:
    return False
