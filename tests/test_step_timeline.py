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


def test_device_idle_gaps_are_charged_to_the_step_they_end_in(capsys):
    """--device-idle's report from a made-up trace: the marker kernel maps the device clock
    onto the host's, each gap goes to the step whose host time holds its end, and busy + idle
    add up to the traced span."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_timeline import Timeline, device_idle_report

    class Event:
        device_type = torch.autograd.DeviceType.CUDA

        def __init__(self, start_us, end_us, name="k"):
            self.time_range = type("Range", (), {"start": start_us, "end": end_us})()
            self.name = name

    timeline = Timeline()
    timeline.marker_host, timeline.origin = 100.0, 100.001
    # host: a decode step at 1-11 ms after the origin, a prefill step at 20-60 ms
    timeline.steps = [(0.0, 0.010, 8, 1, 0), (0.019, 0.040, 0, 0, 300)]
    trace = [Event(0, 1, "marker"), Event(1_000, 4_000), Event(3_000, 6_000),  # overlapping
             Event(9_000, 10_000),     # 3 ms gap ending 9 ms after the marker: the decode step
             Event(30_000, 50_000),    # 20 ms gap ending at 30 ms: the prefill step
             Event(75_000, 77_000)]    # 25 ms gap ending at 75 ms: between steps
    timeline.profiler = type("Profiler", (), {"events": lambda self: trace})()
    device_idle_report(timeline)
    out = capsys.readouterr().out
    assert "device over the timed run: 0.08 s, busy 0.03 s, idle 0.05 s" in out
    rows = {line[:44].strip(): line.split()[-2:] for line in out.splitlines()
            if re.match(r"(decode|prefill|between) ", line)}
    assert rows == {"decode <=    16 rows": ["1", "0.00"],
                    "prefill <=   512 tok": ["1", "0.02"],
                    "between steps": ["1", "0.03"]}
