"""batchgen's engine vs HF transformers `generate` on CPU: the embedded SmolLM2-135M-Instruct,
32 chat prompts of mixed length, 64 new tokens each, greedy, float32, one process, weights
loaded once for each. Prints tokens/s of both and the ratio.

    python benchmarks/cpu_engine.py [--prompts 32] [--new-tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from batchgen.config import EngineConfig, MemoryConfig, ModelConfig
from batchgen.core import Request, SamplingParams
from batchgen.engine.engine import Engine
from batchgen.models.factory import load_model

TOPICS = ["the ocean", "volcanoes", "bread baking", "the Roman empire", "black holes", "chess",
          "honey bees", "jazz", "glaciers", "the printing press", "octopuses", "bicycles"]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        # Mixed lengths, as real batches have (short questions next to pasted context):
        # from ~40 to ~450 tokens, which is where padding costs a static batch the most.
        detail = " Here is some background you may use in your answer." * ((i * 7) % 37)
        messages = [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} to a child.{detail}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def run_batchgen(loaded, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=1.0, host_kv_cache_size=1.0)).validate()
    engine = Engine(loaded.model, cfg, loaded.tokenizer, loaded.eos_token_ids)
    requests = [Request(f"p{i}", p, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                   ignore_eos=True)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - start
    engine.close()
    return elapsed, [r.completions[0].token_ids for r in results]


def run_hf(folder, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(dtype="float32"), torch.device("cpu"))
    prompts = chat_prompts(loaded.tokenizer, args.prompts)
    generated = args.prompts * args.new_tokens
    ours_s, ours = run_batchgen(loaded, prompts, args.new_tokens)
    hf_s, hf = run_hf(loaded.folder, prompts, args.new_tokens)
    same = sum(a == b for a, b in zip(ours, hf))
    lengths = [len(p) for p in prompts]
    print(f"{args.prompts} prompts ({min(lengths)}-{max(lengths)} tokens), {args.new_tokens} new "
          f"tokens each, float32, {args.threads} threads")
    print(f"{'runner':<12}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'batchgen':<12}{ours_s:>10.2f}{generated / ours_s:>12.1f}")
    print(f"{'hf generate':<12}{hf_s:>10.2f}{generated / hf_s:>12.1f}")
    print(f"ratio batchgen / hf: {hf_s / ours_s:.2f}x; identical greedy outputs: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
