"""Step time accounting: a decode burst's forwards are booked as decode time, not scheduling,
also on CPU where queueing a burst runs its forwards there and then."""

from batchgen.config import EngineConfig, MemoryConfig, RuntimeConfig
from batchgen.core import Request, SamplingParams
from batchgen.engine.engine import Engine
from engine_utils import load_ours
from tiny_models import save_tiny_chat_model


def test_burst_forwards_are_decode_time_not_scheduling(tmp_path):
    from transformers import AutoTokenizer

    folder = save_tiny_chat_model(tmp_path)
    model, tokenizer = load_ours(folder), AutoTokenizer.from_pretrained(str(folder))
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.05, host_kv_cache_size=0.1),
                       runtime=RuntimeConfig(decode_burst_steps=8)).validate()
    eng = Engine(model, cfg, tokenizer, ())
    assert not eng.runner.overlaps_host  # CPU: a burst's forwards run while it is queued
    prompt = tokenizer.encode("hello there")
    eng.generate([Request(f"r{i}", prompt, SamplingParams(max_tokens=48, temperature=0.0,
                                                          ignore_eos=True)) for i in range(4)])
    times = eng.times
    assert times.bursts > 0 and times.decode_steps >= 40
    assert times.forward_decode_s > 2 * times.schedule_s, times
