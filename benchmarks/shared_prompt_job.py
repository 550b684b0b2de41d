"""A job whose requests share a long system prompt against the same job with distinct system
prompts of the same length, through `batchgen run` on the embedded default model (CPU or GPU).

    python benchmarks/shared_prompt_job.py --requests 32 --system-words 1200 --max-tokens 16

Three runs, each in a fresh folder, each timed from the command to its exit: the shared prompt
with prefix caching on, the same file with `--no-enable-prefix-caching`, and the distinct
prompts with caching on. Prints a table (wall seconds, prompt tokens, cached prompt tokens) and
whether the shared job's greedy answers are the same with caching on and off.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

WORDS = ("river stone lantern orchard harbor meadow copper violet signal thunder canyon ember "
         "willow summit compass granite marble falcon prairie glacier beacon cedar quartz "
         "harvest tundra anchor saffron cobalt juniper").split()
QUESTIONS = ["What is the capital of France?", "Name a prime number above 20.",
             "Give one word that rhymes with cat.", "What colour is the sky on a clear day?",
             "How many legs does a spider have?", "Name a planet in the solar system.",
             "What is two plus three?", "Name a fruit that is yellow."]


def system_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return "You follow the house rules. " + " ".join(rng.choice(WORDS) for _ in range(words))


def write_job(path: Path, count: int, words: int, max_tokens: int, shared: bool) -> None:
    with path.open("wb") as out:
        for index in range(count):
            system = system_prompt(words, 0 if shared else index + 1)
            body = {"messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
                    "max_tokens": max_tokens, "temperature": 0}
            out.write(orjson.dumps({"custom_id": f"q{index}", "method": "POST",
                                    "url": "/v1/chat/completions", "body": body}) + b"\n")


def run(folder: Path, job: Path, extra: list[str]) -> tuple[float, dict[str, dict]]:
    """(wall seconds, the results by custom_id)."""
    folder.mkdir(parents=True)
    command = [sys.executable, "-m", "batchgen", "run", "--input", str(job),
               "--output", str(folder / "results.jsonl"),
               "--storage-path", str(folder / "storage"), *extra]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"batchgen run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    results = {}
    for line in (folder / "results.jsonl").read_bytes().splitlines():
        row = orjson.loads(line)
        results[row["custom_id"]] = row["response"]["body"]
    return seconds, results


def totals(results: dict[str, dict]) -> tuple[int, int]:
    prompt = cached = 0
    for body in results.values():
        usage = body["usage"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return prompt, cached


def answers(results: dict[str, dict]) -> dict[str, str]:
    return {key: body["choices"][0]["message"]["content"] for key, body in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("extra", nargs="*", help="more `batchgen run` flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shared, distinct = root / "shared.jsonl", root / "distinct.jsonl"
        write_job(shared, args.requests, args.system_words, args.max_tokens, True)
        write_job(distinct, args.requests, args.system_words, args.max_tokens, False)
        runs = {"shared prompt, caching on": run(root / "a", shared, args.extra),
                "shared prompt, caching off": run(root / "b", shared,
                                                  [*args.extra, "--no-enable-prefix-caching"]),
                "distinct prompts, caching on": run(root / "c", distinct, args.extra)}
    print("| job | wall s | prompt tokens | cached prompt tokens |")
    print("|---|---|---|---|")
    for name, (seconds, results) in runs.items():
        prompt, cached = totals(results)
        print(f"| {name} | {seconds:.1f} | {prompt:,} | {cached:,} |")
    on, off = runs["shared prompt, caching on"][1], runs["shared prompt, caching off"][1]
    same = answers(on) == answers(off)
    ratio = runs["shared prompt, caching on"][0] / runs["distinct prompts, caching on"][0]
    print(f"shared / distinct wall time: {ratio:.2f}; greedy answers equal with caching on and "
          f"off: {same}")


if __name__ == "__main__":
    main()
