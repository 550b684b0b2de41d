"""ModelRunner: turns a ScheduleOutput into tensors, runs the model, samples.

The only engine piece that touches tensors besides the models. Order inside a step:
unloads (device -> host), loads (host -> device), forward over the packed batch, sampling.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from batchgen.engine.burst import DecodeBurst
from batchgen.engine.forward_batch import ForwardBatch
from batchgen.engine.kv_cache import KVLayout, KVPool, copy_pages
from batchgen.engine.sampler import HostSample, SamplingRows, sample, sample_on_device
from batchgen.sched.host_pool import HostSegment
from batchgen.sched.scheduler import ScheduleOutput

log = logging.getLogger("batchgen.runner")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, device_pages: int,
                 host_pages: int, device: torch.device, fast_init: bool = False,
                 hugetlbfs: bool = False, runtime=None):
        self.model = model
        self.device = device
        self.layout = layout
        self.device_pool = KVPool(layout, device_pages, device)
        self.host_segment = HostSegment(host_pages * layout.bytes_per_page, fast_init, hugetlbfs)
        self.host_pool = self._host_pool(host_pages)
        self.graphs = None
        if device.type == "cuda":
            self.host_segment.pin()
            if runtime is not None and runtime.use_cuda_graphs:
                self.graphs = self._capture(runtime)

    def _capture(self, runtime):
        from batchgen.engine.graphs import DecodeGraphs

        if getattr(self.model, "expert_stager", None) is not None:
            # Which offloaded experts to copy in is read on the host after routing, every MoE
            # layer of every step: nothing a replayed graph could do.
            log.info("expert offloading is on: decode runs eagerly (no CUDA graphs)")
            return None
        segmented = os.environ.get("BATCHGEN_SEGMENTED_GRAPH", "0") not in ("", "0")
        graphs = DecodeGraphs(self.model, self.device_pool, runtime.cuda_graph_max_bucket_size,
                              runtime.cuda_graph_num_buckets, self.model.max_context, segmented)
        try:
            graphs.capture()
        except Exception as err:  # a model or kernel that cannot be captured still runs
            log.warning("CUDA graph capture failed (%s); decoding eagerly", err)
            return None
        return graphs

    def _host_pool(self, host_pages: int) -> KVPool:
        """Carve the host segment into the page data tensor (and fp8 scales after it)."""
        layout = self.layout
        raw = self.host_segment.tensor
        data_bytes = host_pages * layout.bytes_per_page
        scale_pages = None
        if layout.quantized:
            data_bytes = host_pages * layout.num_layers * 64 * layout.values_per_token
            scale_shape = layout.scale_pages_shape(host_pages)
            scale_pages = (raw[data_bytes:].view(torch.float32)[: math.prod(scale_shape)]
                           .view(scale_shape))
        shape = (host_pages, layout.num_layers, 64, *layout.token_shape)
        data = raw[:data_bytes].view(layout.dtype).view(shape)
        return KVPool(layout, host_pages, "cpu", data=data, scale_pages=scale_pages)

    @torch.inference_mode()
    def execute(self, out: ScheduleOutput, rows: list[SamplingRows], logits_processor=None,
                on_result=None) -> None:
        """Copies, then forward and sampling of `len(rows)` steps: one step of any batch, or
        a burst of back-to-back decode steps (every chunk decodes; `rows[i]` samples step i).
        `on_result(step, result)` receives each step's samples in order, as soon as they are
        on the host: in a burst, while its later steps still run on the device. Returns after
        the last of them (a step that samples nothing is only queued). `logits_processor(logits)`
        may mask the sampled rows' logits in place first (structured outputs; single steps
        only)."""
        for copy in out.swap_out:
            copy_pages(self.device_pool, copy.src, self.host_pool, copy.dst)
        for copy in out.swap_in:
            copy_pages(self.host_pool, copy.src, self.device_pool, copy.dst)
        if not out.chunks:
            return
        if len(rows) > 1:
            self._burst(out, rows, on_result)
            return
        batch = ForwardBatch.build(
            token_ids=[c.seq.token_ids[c.start:c.end] for c in out.chunks],
            starts=[c.start for c in out.chunks],
            page_tables=[c.seq.device_pages for c in out.chunks],
            sample_mask=[c.sample for c in out.chunks],
            kv_pool=self.device_pool,
            device=self.device,
        )
        logits = self._forward(batch)
        if not rows[0].params:
            return
        if logits_processor is not None:
            logits_processor(logits)
        result = sample(logits, rows[0])
        if on_result is not None:
            on_result(0, result)

    def _burst(self, out: ScheduleOutput, rows: list[SamplingRows], on_result) -> None:
        """Queue every step (each takes its input ids from the previous step's samples on the
        device), then hand the samples over step by step: the host's per-token work for step
        i overlaps the device's steps i+1.. instead of leaving the device idle after the burst."""
        burst = DecodeBurst.build([c.seq for c in out.chunks], len(rows), self.device_pool,
                                  self.device)
        input_ids, pending = burst.first_ids, []
        for step, step_rows in enumerate(rows):
            drawn = sample_on_device(self._forward(burst.batch(step, input_ids)), step_rows)
            pending.append(HostSample(drawn))
            input_ids = drawn.tokens
        for step, (host, step_rows) in enumerate(zip(pending, rows)):
            result = host.result(step_rows)
            if on_result is not None:
                on_result(step, result)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model(batch)

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no page copy may still target the segment
        self.host_pool = None
        self.host_segment.close()

