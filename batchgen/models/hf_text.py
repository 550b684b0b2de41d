"""transformers imported for text models only.

Wherever PIL and torchvision are both installed (most GPU machines), transformers' configuration
modules import its image and video helpers, which import torchvision, which imports every
torchvision model and, through its detection ops, torch's compiler stack: ~3.5 s of a worker's
start-up on an H200 machine, for argument checks of image and video processors that a text
model never has. `text_only()` tells transformers torchvision is absent before those helpers
load; tokenizers, configs and models are unaffected.
"""

from __future__ import annotations

import importlib
import sys

VISION_HELPERS = ("transformers.image_utils", "transformers.video_utils")


def text_only() -> None:
    """Make transformers skip its torchvision imports (a no-op once its image helpers are
    loaded, or where transformers has no such check)."""
    if any(name in sys.modules for name in VISION_HELPERS):
        return
    try:
        modules = [importlib.import_module("transformers.utils.import_utils"),
                   importlib.import_module("transformers.utils")]
    except ImportError:
        return
    for module in modules:
        if hasattr(module, "is_torchvision_available"):
            module.is_torchvision_available = _absent


def _absent() -> bool:
    return False
