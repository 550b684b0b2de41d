"""The embedded default model end to end through `batchgen run`: the real command line, intake,
chat template, scheduler and writer, timed from the command's start to its exit.

    python benchmarks/embedded_run.py --requests 2048 --max-tokens 256 [-- extra run flags]

Writes a JSONL of chat requests (varied questions, greedy, no `ignore_eos`: the model stops
when it wants, as in a user's job), runs `python -m batchgen run` on it in a fresh folder, runs
the same command again (it must find the job finished and recompute nothing), and prints a
table: results, errors, prompt and output tokens, seconds from the command to the first result
line on disk, the first run's wall time (model load and
warm-up included) and its output tok/s. `--keep DIR` leaves the job folder there (the
first run's log in `run.log`, the engine's counters in `storage/batches/`).
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

ASKS = ["Explain {} to a ten-year-old.", "Write a short poem about {}.",
        "List three surprising facts about {}.", "What are the pros and cons of {}?",
        "Give me a one-paragraph history of {}.", "How would you teach {} in one lesson?",
        "Write a product description for something inspired by {}.",
        "Summarise the main debates around {} in a few sentences."]
TOPICS = ["volcanoes", "the Roman roads", "sourdough bread", "black holes", "honeybees",
          "the printing press", "jazz", "glaciers", "chess openings", "tidal energy",
          "the immune system", "origami", "lighthouses", "prime numbers", "coral reefs",
          "railway timetables", "the violin", "desert plants", "recycling", "the Moon landing"]


def write_requests(path: Path, count: int, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("wb") as out:
        for index in range(count):
            ask = rng.choice(ASKS).format(rng.choice(TOPICS))
            body = {"messages": [{"role": "user", "content": ask}], "max_tokens": max_tokens,
                    "temperature": 0}
            line = {"custom_id": f"req-{index}", "method": "POST",
                    "url": "/v1/chat/completions", "body": body}
            out.write(orjson.dumps(line) + b"\n")


def run_job(folder: Path, extra: list[str]) -> tuple[float, float | None, str]:
    """(wall seconds, seconds until the first result line was on disk or None, the log)."""
    command = [sys.executable, "-m", "batchgen", "run", "--input", str(folder / "requests.jsonl"),
               "--output", str(folder / "results.jsonl"),
               "--storage-path", str(folder / "storage"), *extra]
    start = time.perf_counter()
    first = None
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            if first is None and _results_written(folder / "storage"):
                first = time.perf_counter() - start
            time.sleep(0.05)
        wall = time.perf_counter() - start
        log.seek(0)
        text = log.read()
    if proc.returncode != 0:
        sys.exit(f"batchgen run exited {proc.returncode}:\n{text[-4000:]}")
    return wall, first, text


def _results_written(storage: Path) -> bool:
    """Whether a result line (or an error line) is in the job's incremental files."""
    folder = storage / "incremental"
    try:
        return any(p.stat().st_size > 0 for p in folder.glob("*.jsonl"))
    except OSError:
        return False


def usage_totals(results: Path) -> tuple[int, int, int]:
    lines = [orjson.loads(line) for line in results.read_bytes().splitlines()]
    usage = [line["response"]["body"]["usage"] for line in lines]
    return (len(lines), sum(u["prompt_tokens"] for u in usage),
            sum(u["completion_tokens"] for u in usage))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="job folder to keep (default: a temp folder)")
    parser.add_argument("extra", nargs="*", help="more `batchgen run` flags, after --")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="embedded-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    write_requests(folder / "requests.jsonl", args.requests, args.max_tokens, args.seed)

    wall, first, log = run_job(folder, args.extra)
    (folder / "run.log").write_text(log)
    first_log = log
    results, prompt_tokens, output_tokens = usage_totals(folder / "results.jsonl")
    errors_file = folder / "results.errors.jsonl"
    errors = len(errors_file.read_bytes().splitlines()) if errors_file.exists() else 0
    again, _, log = run_job(folder, args.extra)
    unchanged = usage_totals(folder / "results.jsonl") == (results, prompt_tokens, output_tokens)

    first_s = "-" if first is None else f"{first:.1f}"
    print(f"| requests | results | errors | prompt tokens | output tokens | first result s "
          f"| wall s | out tok/s | rerun s | rerun unchanged |\n"
          f"|---|---|---|---|---|---|---|---|---|---|\n"
          f"| {args.requests} | {results} | {errors} | {prompt_tokens} | {output_tokens} "
          f"| {first_s} | {wall:.1f} | {output_tokens / wall:,.0f} | {again:.1f} | {unchanged} |")
    startup = [line for line in first_log.splitlines() if "start-up:" in line]
    if startup:
        print(startup[-1].split("batchgen: ", 1)[-1])
    print("rerun said:", log.strip().splitlines()[-1] if log.strip() else "(nothing)")


if __name__ == "__main__":
    main()
