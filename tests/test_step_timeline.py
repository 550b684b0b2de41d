"""benchmarks/step_timeline.py on toy widths: every timed step is classed, and the table's
token columns add up to the workload."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_timeline_accounts_for_every_prompt_and_output_token():
    requests, input_len, output_len = 12, 40, 9
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/step_timeline.py"), "--tiny", "--requests",
         str(requests), "--input-len", str(input_len), "--output-len", str(output_len),
         "--max-decode-batch", "8", "--slices", "3"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines()
            if re.match(r"(decode|prefill) ", line)]
    assert rows, out.stdout
    decode = prefill = 0
    for line in rows:
        numbers = [float(x) for x in re.findall(r"\s(\d+(?:\.\d+)?)(?=\s|$)", line)]
        calls, forwards, tokens, prompt, seconds, per_forward = numbers[-6:]
        assert calls >= 1 and forwards >= calls and seconds >= 0
        decode += tokens
        prefill += prompt
    # each request's first token is sampled at the end of its prefill, the rest by decode rows
    assert decode == requests * (output_len - 1)
    assert prefill == requests * input_len
    assert "spans of" in out.stdout
