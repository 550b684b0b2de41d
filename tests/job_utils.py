"""Run `batchgen` as a user would: a subprocess, in its own process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BATCHGEN = [sys.executable, "-c", "from batchgen.__main__ import main; main()"]


def batchgen(*args, check=False, timeout=300, env=None, **kw) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([*BATCHGEN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd="/", **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"batchgen {args} -> {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def start(*args, env=None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([*BATCHGEN, *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd="/",
                            start_new_session=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_rows(count: int, max_tokens: int = 24, temperature: float = 0.0) -> list[dict]:
    topics = ["the sea", "a mountain", "bread", "rain", "a library", "trains", "owls", "snow"]
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user",
                                    "content": f"Tell me about {topics[i % 8]} ({i})."}],
                      "max_tokens": max_tokens + (i % 5) * 7, "temperature": temperature}}
            for i in range(count)]
