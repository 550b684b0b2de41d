"""Fault injection for in-flight checkpoints: stop (SIGTERM) or kill (SIGKILL) a job at random
moments, resume it each time, and check its results against an uninterrupted run of the same
input; prints the tokens drawn again after each resume.

    python benchmarks/inflight_faults.py --model MODEL_DIR --work /tmp/faults \\
        --requests 32 --max-tokens 60 --temperature 0.8 --signal TERM --stops 10

--model embedded uses the embedded model. Results are compared with the job's start time
(`created`, the one field in which two separate jobs differ) taken out; everything else,
text, token counts and finish reasons included, must be byte for byte the same.

Tokens drawn again = tokens generated over every attempt - tokens of the uninterrupted run
(each worker's stats file reports the tokens its engine drew). For SIGKILL the stats file is
the one from just before the kill: kills are sent right after a stats write (they land
between steps, at a random point of the checkpoint interval), so the count is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

BATCHGEN = [sys.executable, "-c", "from batchgen.__main__ import main; main()"]


def rows(count: int, max_tokens: int, temperature: float) -> list[dict]:
    topics = ["the sea", "a mountain", "bread", "rain", "a library", "trains", "owls", "snow"]
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user",
                                    "content": f"Tell me about {topics[i % 8]} ({i})."}],
                      "max_tokens": max_tokens + (i % 5) * 7, "temperature": temperature}}
            for i in range(count)]


def args_for(inp: Path, storage: Path, model: str, extra: list[str]) -> list[str]:
    model_args = [] if model == "embedded" else ["--model", model]
    return ["run", "--input", str(inp), "--storage-path", str(storage), "--seed", "3",
            "--preempt-grace", "60", *model_args, *extra]


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([*BATCHGEN, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def worker_stats(storage: Path) -> list[dict]:
    out = []
    for path in sorted((storage / "batches").glob("*.worker*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return out


def generated(storage: Path) -> int:
    return sum(w.get("engine", {}).get("generated_tokens", 0) for w in worker_stats(storage))


def results(storage: Path) -> list[dict]:
    out = [p for p in sorted((storage / "outputs").glob("*.jsonl"))
           if not p.name.endswith(".errors.jsonl")]
    lines = [json.loads(line) for line in out[0].read_text().splitlines()]
    for line in lines:
        line["response"]["body"].pop("created", None)
    return lines


def lines_saved(storage: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (storage / "incremental").glob("*.jsonl"))


def stats_written(storage: Path, after: float) -> bool:
    paths = list((storage / "batches").glob("*.worker*.json"))
    return bool(paths) and min(p.stat().st_mtime for p in paths) > after


def wait(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def clean_run(inp: Path, storage: Path, model: str, extra: list[str]) -> tuple[int, float]:
    t0 = time.monotonic()
    proc = start(args_for(inp, storage, model, extra))
    _, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"uninterrupted run failed ({proc.returncode}): {err[-2000:]}")
    return generated(storage), time.monotonic() - t0


def interrupted_run(inp: Path, storage: Path, model: str, extra: list[str], sig: signal.Signals,
                    stops: int, rng: random.Random, window: float) -> list[dict]:
    """`stops` attempts ended by `sig` at a random moment of the generation, then one run to
    the end; per attempt: exit code, results saved, tokens drawn, checkpoint figures."""
    attempts = []
    for _ in range(stops + 1):
        before = lines_saved(storage)
        for path in (storage / "batches").glob("*.worker*.json"):
            path.unlink()  # the attempt's own figures only
        proc = start(args_for(inp, storage, model, extra))
        last = len(attempts) == stops
        if not last and wait(lambda: _generating(storage) or proc.poll() is not None, 600):
            time.sleep(rng.uniform(0, window))
            if sig is signal.SIGKILL:  # right after a stats write: its token count is current
                mark = time.time()
                wait(lambda: stats_written(storage, mark), 10)
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
        _, err = proc.communicate()
        stats = worker_stats(storage)
        attempts.append({
            "exit": proc.returncode, "results_saved": lines_saved(storage) - before,
            "generated": generated(storage),
            "resumed_tokens": sum(w.get("checkpoint", {}).get("resumed_tokens", 0)
                                  for w in stats),
            "resumed_requests": sum(w.get("checkpoint", {}).get("resumed_requests", 0)
                                    for w in stats),
            "checkpoint_tokens_at_exit": sum(w.get("checkpoint", {}).get("tokens", 0)
                                             for w in stats),
            "unsaved_at_exit": sum(w.get("engine", {}).get("generated_tokens", 0)
                                   - w.get("checkpoint", {}).get("generated_at_save", 0)
                                   for w in stats),
            "checkpoint_max_s": max((w.get("checkpoint", {}).get("max_seconds", 0.0)
                                     for w in stats), default=0.0),
            "checkpoint_saves": sum(w.get("checkpoint", {}).get("saves", 0) for w in stats)})
        if proc.returncode not in (0, 75, -9, 137):
            sys.exit(f"attempt ended with {proc.returncode}: {err[-3000:]}")
        if proc.returncode == 0:
            break
    return attempts


def _generating(storage: Path) -> bool:
    """The attempt's worker reported its first step (the model is loaded)."""
    return any("engine" in w for w in worker_stats(storage))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder, or 'embedded'")
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--signal", choices=["TERM", "KILL"], default="TERM")
    p.add_argument("--stops", type=int, default=10)
    p.add_argument("--interval", type=float, default=30.0,
                   help="--inflight-checkpoint-interval of the interrupted job")
    p.add_argument("--window", type=float, default=None,
                   help="seconds after generation starts in which a stop lands (default: the "
                        "clean run's time / (stops + 1))")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    a.work.mkdir(parents=True, exist_ok=True)
    inp = a.work / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n"
                           for r in rows(a.requests, a.max_tokens, a.temperature)))
    clean_storage, storage = a.work / "clean", a.work / f"stopped-{a.signal}-{seed}"
    clean_tokens, clean_s = (clean_run(inp, clean_storage, a.model, [])
                             if not (clean_storage / "outputs").is_dir()
                             else (generated(clean_storage), 0.0))
    window = a.window or max(1.0, clean_s / (a.stops + 1))
    sig = signal.SIGTERM if a.signal == "TERM" else signal.SIGKILL
    attempts = interrupted_run(inp, storage, a.model,
                               ["--inflight-checkpoint-interval", str(a.interval)], sig,
                               a.stops, rng, window)
    same = results(storage) == results(clean_storage)
    total = sum(x["generated"] for x in attempts)
    for i, x in enumerate(attempts):
        print(f"attempt {i}: " + json.dumps(x))
    stopped = sum(1 for x in attempts if x["exit"] != 0)
    in_flight = sum(x["resumed_requests"] for x in attempts)
    print(json.dumps({"seed": seed, "signal": a.signal, "requests": a.requests,
                      "temperature": a.temperature, "interval_s": a.interval,
                      "stops": stopped, "identical": same,
                      "tokens_uninterrupted": clean_tokens, "tokens_all_attempts": total,
                      "regenerated_tokens": total - clean_tokens,
                      "requests_resumed_from_checkpoint": in_flight,
                      "tokens_resumed_from_checkpoint": sum(x["resumed_tokens"]
                                                            for x in attempts)}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
