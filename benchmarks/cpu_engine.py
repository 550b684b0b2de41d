"""batchgen's engine vs HF transformers `generate` on CPU: the embedded SmolLM2-135M-Instruct,
32 chat prompts of mixed length, 64 new tokens each, greedy, float32, one process, the same
thread count for both, weights loaded once for each, and one short untimed warm-up run for
each (first-call allocations and lazy initialisation are not what is measured). Prints
tokens/s of both, the ratio, and how many greedy outputs are identical.

    OMP_NUM_THREADS=1 python benchmarks/cpu_engine.py --threads 1 [--prompts 32] [--new-tokens 64]
        [--max-prefill-tokens 8192]
"""

from __future__ import annotations

import argparse
import time

import torch

from batchgen.config import EngineConfig, MemoryConfig, ModelConfig, SchedulerConfig
from batchgen.core import Request, SamplingParams
from batchgen.engine.engine import Engine
from batchgen.models.factory import load_model

WARMUP_TOKENS = 4
"""New tokens of the untimed warm-up run (two short prompts: prefill and decode run once)."""
TOPICS = ["the ocean", "volcanoes", "bread baking", "the Roman empire", "black holes", "chess",
          "honey bees", "jazz", "glaciers", "the printing press", "octopuses", "bicycles"]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        # Mixed lengths, as real batches have (short questions next to pasted context):
        # from ~40 to ~450 tokens, which is where padding costs a static batch the most.
        detail = " Here is some background you may use in your answer." * ((i * 7) % 37)
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "user", "content": f"Explain {topic} to a child.{detail}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def run_batchgen(loaded, prompts, new_tokens,
                 max_prefill_tokens: int) -> tuple[Timer, list[list[int]]]:
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=1.0, host_kv_cache_size=1.0),
                       scheduler=SchedulerConfig(max_prefill_tokens=max_prefill_tokens)).validate()
    engine = Engine(loaded.model, cfg, loaded.tokenizer, loaded.eos_token_ids)

    def requests(batch, tag, tokens):
        return [Request(f"{tag}{i}", p, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                       ignore_eos=True))
                for i, p in enumerate(batch)]

    engine.generate(requests(warmup_prompts(prompts), "warmup", WARMUP_TOKENS))
    with Timer() as timer:
        results = engine.generate(requests(prompts, "p", new_tokens))
    engine.close()
    return timer, [r.completions[0].token_ids for r in results]


def run_hf(folder, prompts, new_tokens) -> tuple[Timer, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def generate(batch, tokens):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    generate(warmup_prompts(prompts), WARMUP_TOKENS)
    with Timer() as timer:
        out = generate(prompts, new_tokens)
    return timer, out


class Timer:
    """Wall seconds, and CPU seconds of this process: on a shared machine the CPU time shows
    how much of the wall time was spent waiting for a core."""

    def __enter__(self):
        self.wall, self.cpu = -time.perf_counter(), -time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter()
        self.cpu += time.process_time()


def warmup_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Two short prompts: enough to run every code path once (prefill and decode)."""
    return [p[:16] for p in prompts[:2]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-prefill-tokens", type=int,
                        default=SchedulerConfig.max_prefill_tokens,
                        help="batchgen's token budget per prefill step (engine default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(dtype="float32"), torch.device("cpu"))
    prompts = chat_prompts(loaded.tokenizer, args.prompts)
    generated = args.prompts * args.new_tokens
    ours_t, ours = run_batchgen(loaded, prompts, args.new_tokens, args.max_prefill_tokens)
    hf_t, hf = run_hf(loaded.folder, prompts, args.new_tokens)
    same = sum(a == b for a, b in zip(ours, hf))
    lengths = [len(p) for p in prompts]
    print(f"{args.prompts} prompts ({min(lengths)}-{max(lengths)} tokens), {args.new_tokens} new "
          f"tokens each, float32, {args.threads} threads")
    print(f"{'runner':<12}{'seconds':>10}{'cpu s':>10}{'tokens/s':>12}")
    for name, t in (("batchgen", ours_t), ("hf generate", hf_t)):
        print(f"{name:<12}{t.wall:>10.2f}{t.cpu:>10.2f}{generated / t.wall:>12.1f}")
    print(f"ratio batchgen / hf: {hf_t.wall / ours_t.wall:.2f}x (cpu time "
          f"{hf_t.cpu / ours_t.cpu:.2f}x); identical greedy outputs: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
