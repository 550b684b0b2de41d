"""Start-up's precompile pass on a stand-in of the job's model, before its weights load.

The Triton kernel variants a model's CUDA-graph capture and first steps launch depend on its
layer shapes and dtypes, not on its weights or depth. So once the model's config is read, a
stand-in (its first two and last two decoder layers, random weights: bench_models.
stand_in_model) runs the capture's forwards with every new variant noted and skipped; the
compile processes build those variants while the real weights load, and the capture later only
waits for them (engine/runner.py `precompile_stand_in`, engine/precompile.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from batchgen.bench_models import stand_in_model
from batchgen.config import EngineConfig
from batchgen.engine.precompile import CompileWorkers
from batchgen.engine.runner import precompile_stand_in
from batchgen.parallel import TensorParallel


def precompile_hook(workers: CompileWorkers | None, device: torch.device, cfg: EngineConfig,
                    job_sequences: int, tp: TensorParallel, done: Callable[[], None]):
    """load_model's `before_weights` for this job: the stand-in's pass with `workers`, then
    `done()`; None where there are no workers or the model is split over several GPUs (the
    capture then runs the pass itself, after the load)."""
    if workers is None or tp.size > 1:
        return None

    def before_weights(hf_config, dtype: torch.dtype) -> None:
        def build() -> torch.nn.Module | None:
            model = stand_in_model(hf_config, dtype, device, cfg.model)
            if model is not None and cfg.model.max_model_len:  # as load_model caps the real one
                model.max_context = min(model.max_context, cfg.model.max_model_len)
            return model

        precompile_stand_in(build, cfg, workers, job_sequences)
        done()

    return before_weights
