"""Time to the first new result after a resume with many requests in flight, against the time
of one prefill of those requests (prompt + generated tokens) and against a restart without
checkpoints (every answer drawn again from its prompt).

    python benchmarks/inflight_resume_latency.py --model embedded --requests 128

Requests ask for staggered max_tokens (--max-tokens + i % 32, greedy, EOS ignored) and are
stopped once each has drawn --stop-at tokens, as a job stopped mid-run holds them: at
various distances from their ends.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from batchgen.config import EngineConfig, ModelConfig, RuntimeConfig
from batchgen.core import Request, SamplingParams
from batchgen.engine.engine import Engine
from batchgen.models.factory import load_model


def engine_for(loaded, burst: int = RuntimeConfig.decode_burst_steps) -> Engine:
    cfg = EngineConfig(runtime=RuntimeConfig(decode_burst_steps=burst))
    return Engine(loaded.model, cfg.validate(), loaded.tokenizer, loaded.eos_token_ids)


def requests(tokenizer, count: int, max_tokens: int) -> list[Request]:
    out = []
    for i in range(count):
        text = f"Write a short story about item number {i} and the sea."
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(chat, add_special_tokens=False)
        out.append(Request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens + i % 32,
                                                        temperature=0.0, ignore_eos=True)))
    return out


def first_result(engine: Engine, todo: list[Request]) -> float:
    for request in todo:
        engine.add_request(request)
    start = time.perf_counter()
    while True:
        if engine.step():
            return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded", help="model folder, or 'embedded'")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--stop-at", type=int, default=36)
    a = p.parse_args()
    cfg = ModelConfig() if a.model == "embedded" else ModelConfig(model=a.model)
    loaded = load_model(cfg, torch.device("cpu"))
    todo = requests(loaded.tokenizer, a.requests, a.max_tokens)

    engine = engine_for(loaded, burst=1)  # stops exactly at --stop-at
    for request in todo:
        engine.add_request(request)
    while min((len(c.token_ids) for p in engine.inflight_state().values() for c in p),
              default=a.stop_at) < a.stop_at:
        assert not engine.step(), "a request finished before the stop: raise --max-tokens"
    state = engine.inflight_state()
    in_flight = len(state)
    saved = sum(len(c.token_ids) for p in state.values() for c in p)
    closest = min(r.sampling.max_tokens - len(state[r.request_id][0].token_ids) for r in todo)
    engine.close()

    resumed = [replace(r, resume=state[r.request_id]) for r in todo]
    resume_s = first_result(engine_for(loaded), resumed)
    # One prefill of the same tokens: prompt + generated as prompts, one token each.
    whole = [Request(r.request_id, r.prompt_token_ids + state[r.request_id][0].token_ids,
                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
             for r in todo]
    prefill = engine_for(loaded)
    start = time.perf_counter()
    prefill.generate(whole)
    prefill_s = time.perf_counter() - start
    restart_s = first_result(engine_for(loaded), todo)
    print(json.dumps({"requests_in_flight": in_flight, "tokens_saved": saved,
                      "closest_request_tokens_left": closest,
                      "prompt_tokens": sum(len(r.prompt_token_ids) for r in todo),
                      "first_result_after_resume_s": round(resume_s, 3),
                      "one_prefill_of_prompt_plus_generated_s": round(prefill_s, 3),
                      "ratio": round(resume_s / prefill_s, 2),
                      "first_result_restart_without_checkpoint_s": round(restart_s, 3)}))
    return 0 if resume_s <= 2 * prefill_s else 1


if __name__ == "__main__":
    raise SystemExit(main())
