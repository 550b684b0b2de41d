"""What a resumed job saves by reusing its parsed input: an N-line chat input parsed into a
job's store as the first run does, then again as a resume does (stamp and store digest
checked, nothing parsed), and with the stamp removed (parsed again). CPU only, no model.

    python benchmarks/parse_reuse.py --lines 1000000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import orjson

from batchgen.io.parsed_input import parse_input, stamp_of
from batchgen.io.reader import identify_input


def write_input(path: Path, lines: int) -> None:
    with open(path, "wb") as f:
        for i in range(lines):
            body = {"messages": [{"role": "system", "content": "You answer briefly."},
                                 {"role": "user", "content": f"Question {i}: what is {i} + 7?"}],
                    "max_tokens": 32}
            f.write(orjson.dumps({"custom_id": f"r{i}", "method": "POST",
                                  "url": "/v1/chat/completions", "body": body}) + b"\n")


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        inp, store = Path(tmp) / "in.jsonl", Path(tmp) / "job.requests"
        write_input(inp, args.lines)
        hashed, source = timed(lambda: identify_input(inp))
        first, summary = timed(lambda: parse_input(source, store, 8 << 20, 16))
        reused, again = timed(lambda: parse_input(source, store, 8 << 20, 16))
        stamp_of(store).unlink()
        parsed, _ = timed(lambda: parse_input(source, store, 8 << 20, 16))
        assert again == summary
        print(f"{args.lines:,} lines, input {source.size_bytes / 1e6:.0f} MB, store "
              f"{store.stat().st_size / 1e6:.0f} MB; the input's sha256 {hashed:.2f} s (every run)")
        print(f"first run parses {first:.2f} s; a resume reuses the store {reused:.2f} s; "
              f"without the stamp it parses again {parsed:.2f} s")


if __name__ == "__main__":
    main()
