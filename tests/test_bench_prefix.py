"""`batchgen bench` shared-prefix workloads and --compare-prefix-caching, on a tiny SmolLM2
shape on CPU (float32: the two runs' greedy tokens must agree)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from batchgen.bench import Workload


def test_shared_prefix_prompts_share_their_first_tokens():
    work = Workload(requests=40, input_len=20, shared_prefix_len=12, num_prefixes=3)
    prompts = work.prompts(1000)
    heads = {tuple(p[:12]) for p in prompts}
    assert len(heads) == 3  # every prefix drawn, shuffled over the requests
    assert len({tuple(p[12:]) for p in prompts}) == 40
    assert Workload(requests=4, input_len=20).prompts(1000) != prompts[:4]


def test_compare_prefix_caching_reports_both_runs_with_the_same_tokens(tmp_path):
    from batchgen.cli import app

    out = tmp_path / "report.json"
    args = ["bench", "--shape", "smollm2-135m", "--tiny", "--device", "cpu",
            "--requests", "12", "--input-len", "200", "--shared-prefix-len", "150",
            "--num-prefixes", "2", "--output-len", "8", "--n", "2",
            "--compare-prefix-caching", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "prefix caching on (batchgen) / off" in result.output
    assert "same tokens" in result.output
    report = json.loads(out.read_text())
    rows, section = report["results"], report["prefix_caching"]
    for name in ("batchgen", "prefix_caching_off"):
        assert rows[name]["output_tokens"] == 12 * 2 * 8  # n = 2 samples of each prompt
    assert section["same_tokens"]
    assert section["on"]["cached_prompt_tokens"] > 0 and section["on"]["forks"] > 0
    assert section["off"]["cached_prompt_tokens"] == 0 and section["off"]["forks"] == 0
    assert section["ratio"] == rows["batchgen"]["output_tok_s"] / rows[
        "prefix_caching_off"]["output_tok_s"]


def test_bad_shared_prefix_is_one_line(tmp_path):
    from batchgen.cli import app

    result = CliRunner().invoke(app, ["bench", "--tiny", "--device", "cpu", "--input-len", "10",
                                      "--shared-prefix-len", "20"])
    assert result.exit_code != 0 and "--shared-prefix-len must be in [0, --input-len]" in (
        result.output)
