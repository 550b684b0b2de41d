"""What the model-family test files share: random prompts of several lengths, our greedy
tokens, transformers' float32 model of a folder, and a `batchgen run` of chat lines on a tiny
model of a family checked against transformers' greedy answers."""

from __future__ import annotations

from pathlib import Path

import torch
from engine_utils import greedy_requests, hf_greedy, make_engine
from job_utils import batchgen, read_jsonl, write_jsonl
from tiny_models import VOCAB, embedded_tokenizer, save_tiny_model

NEW_TOKENS = 40


def prompts(seed=0, lengths=(3, 17, 64, 65, 150)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def greedy(model, ps, max_tokens=NEW_TOKENS) -> list[list[int]]:
    results = make_engine(model).generate(greedy_requests(ps, max_tokens, ignore_eos=True))
    return [r.completions[0].token_ids for r in results]


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def check_chat_run_matches_transformers(family: str, tmp_path: Path) -> None:
    """`batchgen run` of two chat lines on a tiny `family` model with the embedded model's
    tokenizer: each answer is transformers' greedy text, with as many tokens (EOS counted)."""
    tokenizer = embedded_tokenizer()
    folder = save_tiny_model(family, tmp_path / "model", vocab_size=len(tokenizer),
                             bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(str(folder))
    questions = ["Tell me about the sea.", "What is bread?"]
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": q}], "max_tokens": 8,
                      "temperature": 0}} for i, q in enumerate(questions)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    batchgen("run", "-i", tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--model", folder,
             check=True)
    results = {r["custom_id"]: r["response"] for r in read_jsonl(tmp_path / "out.jsonl")}
    hf = hf_model(folder)
    for i, question in enumerate(questions):
        response = results[f"q{i}"]
        assert response["status_code"] == 200
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, tokenize=False)
        want = hf_greedy(hf, tokenizer(prompt, add_special_tokens=False)["input_ids"], 8)
        assert response["body"]["usage"]["completion_tokens"] == len(want)  # EOS counted
        if tokenizer.eos_token_id in want:
            want = want[: want.index(tokenizer.eos_token_id)]
        message = response["body"]["choices"][0]["message"]["content"]
        assert message == tokenizer.decode(want, skip_special_tokens=True)
