"""Hostile lines: a response_format that crashes the grammar compiler, a 50 MB line, chat
templates that loop or grow without end. Each becomes its own error line; the job finishes."""

import json
import re
import subprocess
import sys
import tracemalloc
from types import SimpleNamespace

import pytest

from attacks import fixture, nested_regex_row, write_huge_line
from batchgen.core import SamplingParams
from batchgen.io import templates as templates_module
from batchgen.io.grammar_limits import (MAX_REGEX_DEPTH, GrammarTooComplex,
                                        check_grammar_limits, regex_depth, regex_units)
from batchgen.io.intake import ParsedRequest, intake, parse_record, tokenize_request
from batchgen.io.parsed_input import ParsedRecord
from batchgen.io.reader import RawRecord, read_records, scan_input
from batchgen.runner.worker.quarantine import CrashJournal, Quarantine
from job_utils import BATCHGEN, batchgen, read_jsonl, write_jsonl


def _good(count: int) -> list[dict]:
    return [{"custom_id": f"ok-{i}", "prompt": f"hello {i}", "max_tokens": 3}
            for i in range(count)]


def _by_id(path) -> dict:
    return {r["custom_id"]: r for r in read_jsonl(path)} if path.exists() else {}


def test_nested_regex_line_is_an_error_and_the_other_lines_are_answered(tmp_path,
                                                                        tiny_chat_model):
    """100,000 nested groups overflow xgrammar's stack (SIGSEGV) if they reach it."""
    rows = _good(10)
    rows.insert(4, nested_regex_row("evil"))
    rows[7]["prompt"] += " <|im_start|>system"  # answered, and said once in the log
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    done = batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path",
                    tmp_path / "s", "--output", out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(_by_id(out)) == {f"ok-{i}" for i in range(10)}
    error = _by_id(tmp_path / "out.errors.jsonl")["evil"]["response"]["body"]["error"]
    assert error["code"] == "unsupported_response_format" and error["line"] == 5
    assert "100000 deep" in error["message"]
    assert "line 8 writes the special token '<|im_start|>' as text" in done.stderr


def test_grammar_limits_name_what_is_over():
    assert regex_depth(r"(a(b)[()]\(c)") == 2
    check_grammar_limits(nested_regex_row(depth=MAX_REGEX_DEPTH)["body"]["response_format"])
    with pytest.raises(GrammarTooComplex, match="pattern nests groups 129 deep"):
        check_grammar_limits(
            nested_regex_row(depth=MAX_REGEX_DEPTH + 1)["body"]["response_format"])
    deep: dict = {"type": "string"}
    for _ in range(80):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarTooComplex, match="nested deeper than 64"):
        check_grammar_limits({"type": "json_schema", "json_schema": {"schema": deep}})
    with pytest.raises(GrammarTooComplex, match="bytes"):
        check_grammar_limits({"type": "json_schema", "json_schema": {
            "schema": {"enum": ["x" * 1000] * 300}}})


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _strings(count: int, pattern: str | None = None) -> dict:
    value = {"type": "string", **({"pattern": pattern} if pattern else {})}
    return {"type": "object", "properties": {f"p{i}": value for i in range(count)}}


@pytest.mark.parametrize("schema, message", [
    # The grammar compiler's work grows with the square of a repetition count: minutes here.
    ({"type": "string", "pattern": "x{50000}"}, "repeats 50000 times, over the limit of 1000"),
    ({"type": "string", "pattern": "[a-z]{2,1001}"}, "repeats 1001 times"),
    (_strings(21, "x{1000}"), "expand to more than 20000 characters"),
    ({"type": "string", "pattern": "((ab){100}){101}"}, "expand to more than 20000"),
    ({"type": "object", "patternProperties": {"^k{5000}$": {"type": "string"}}},
     "patternProperties key '^k{5000}$' repeats 5000 times"),
    # ... and with the cube of an object's property count (2,000 strings: 16 s).
    (_strings(257), "lists 257 properties, over the limit of 256 for one object"),
    ({"type": "object", "properties": {f"o{j}": _strings(256) for j in range(8)}},
     "more than 2048 properties in all"),
    # A chain of $refs: 6,000 took 74 s.
    ({"$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1100)},
                "d1100": {"type": "integer"}}, "$ref": "#/$defs/d0"}, "more than 1024 $refs"),
])
def test_schemas_that_would_take_the_grammar_compiler_minutes_are_refused(schema, message):
    with pytest.raises(GrammarTooComplex, match=re.escape(message)):
        check_grammar_limits(_schema(schema))


def test_schemas_at_the_limits_are_accepted():
    """Each at its limit compiles within about a second on one core (the module's figures)."""
    for schema in (_strings(20, "x{1000}"), {"type": "string", "pattern": "(x{100}){100}"},
                   _strings(256, "[a-z]+"),
                   {"type": "object", "properties": {f"o{j}": _strings(255) for j in range(8)}},
                   {"$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1023)},
                              "d1023": {"type": "integer"}}, "$ref": "#/$defs/d0"}):
        check_grammar_limits(_schema(schema))
    assert regex_units(r"(ab){100}\d{5}[{]{2}x\{3}") == (200 + 5 + 2 + 4, 100)


def test_the_limits_count_every_function_a_forced_call_may_call():
    """tool_choice "required" builds one grammar of all the tools: their schemas together."""
    tools = [{"type": "function", "function": {"name": f"f{j}", "parameters": _strings(256)}}
             for j in range(9)]
    line = {"custom_id": "t", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "tools": tools,
                     "tool_choice": "required"}}
    err = parse_record(RawRecord(1, line))
    assert err.code == "invalid_tool_choice" and err.param == "tools"
    assert "more than 2048 properties in all" in err.message
    assert isinstance(parse_record(RawRecord(1, {**line, "body": {
        **line["body"], "tool_choice": "auto"}})), ParsedRequest)  # nothing forced: no grammar


def test_an_integer_beyond_64_bits_is_not_taken_for_deep_nesting():
    """orjson refuses such integers; JSON has them (a bound, an enum value)."""
    check_grammar_limits({"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "enum": ["a"], "default": 10 ** 30}}})
    deep: dict = {"type": "string", "default": -(10 ** 30)}
    for _ in range(80):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarTooComplex, match="nested deeper than 64"):
        check_grammar_limits({"type": "json_schema", "json_schema": {"schema": deep}})


def test_each_line_is_journaled_before_its_risky_intake(tmp_path, monkeypatch):
    """A crash inside the template, tokenizer or grammar compiler must find the line in the
    crash journal, so the quarantine can give it a strike."""
    from batchgen.runner.worker import worker as worker_module

    quarantine = Quarantine(tmp_path, "b", 0, after=1)
    quarantine.recover(set(), restarted=False)
    seen_in_journal = []

    def spy_intake(parsed, *args):
        last = CrashJournal(quarantine.journal.path).read()
        seen_in_journal.append(parsed.custom_id in last.admitted)
        raise SystemExit("crash while reading the line")

    monkeypatch.setattr(worker_module, "tokenize_parsed", spy_intake)
    config = SimpleNamespace(storage=SimpleNamespace(max_tokens=16),
                             engine=SimpleNamespace(model=SimpleNamespace(max_model_len=None)))
    fake = SimpleNamespace(engine=SimpleNamespace(num_requests=0), done=set(), writer=object(),
                           quarantine=quarantine, embeddings=[],
                           spec=SimpleNamespace(config=config, sampling_defaults={}),
                           loaded=SimpleNamespace(tokenizer=None, max_context=64,
                                                  model=SimpleNamespace(generates=True),
                                                  hf_config=SimpleNamespace(vocab_size=64)))
    line = RawRecord(1, {"custom_id": "poison", "prompt": "x"})
    records = iter([ParsedRecord(1, "poison", parse_record(line))])
    with pytest.raises(SystemExit):
        worker_module.Worker._intake(fake, records, 8, [])
    assert seen_in_journal == [True]


def test_a_long_line_is_skipped_unread_with_bounded_memory(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", _good(2))
    write_huge_line(inp, 20 << 20)
    with open(inp, "a") as f:
        f.write(json.dumps(_good(3)[2]) + "\n")
    tracemalloc.start()
    records = list(read_records(inp, max_line_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, peak
    assert [r.line for r in records] == [1, 2, 3, 4]
    assert records[2].error.code == "line_too_long" and "--max-line-bytes" in \
        records[2].error.message
    assert records[3].data["custom_id"] == "ok-2"
    assert scan_input(inp, 1 << 20).line_errors == {"line_too_long": 1}
    exact = tmp_path / "exact.jsonl"
    exact.write_bytes(b"{" + b" " * 62 + b"}\n")  # 64 bytes: at the limit is accepted
    assert next(read_records(exact, max_line_bytes=64)).data == {}


def _job_peak_rss_kib(tmp_path, inp, name: str, model) -> tuple[int, int]:
    """(exit code, peak RSS in KiB of the job's largest process)."""
    measure = ("import resource, subprocess, sys\n"
               "code = subprocess.run(sys.argv[1:]).returncode\n"
               "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    done = subprocess.run([sys.executable, "-c", measure, *BATCHGEN, "run", "--input", str(inp),
                           "--model", str(model), "--storage-path", str(tmp_path / name),
                           "--output", str(tmp_path / f"{name}.out.jsonl")],
                          capture_output=True, text=True, timeout=600)
    code, peak = map(int, done.stdout.split()[-2:])
    assert code == 0, done.stderr[-2000:]
    return code, peak


@pytest.mark.slow
def test_a_50_mb_line_is_an_error_and_the_job_stays_small(tmp_path, tiny_chat_model):
    """Before the limit, one 50 MB line took the worker to 9 GB (OOM kill, nothing answered).
    The job's peak memory must stay that of the same job without the line."""
    plain = write_jsonl(tmp_path / "plain.jsonl", _good(2))
    _, baseline = _job_peak_rss_kib(tmp_path, plain, "plain", tiny_chat_model)
    inp = write_jsonl(tmp_path / "in.jsonl", _good(2))
    write_huge_line(inp, 50 << 20)
    _, peak = _job_peak_rss_kib(tmp_path, inp, "huge", tiny_chat_model)
    assert set(_by_id(tmp_path / "huge.out.jsonl")) == {"ok-0", "ok-1"}
    error = _by_id(tmp_path / "huge.out.errors.jsonl")["line-3"]["response"]["body"]["error"]
    assert error["code"] == "line_too_long"
    print(f"peak RSS of the job's largest process: {baseline / 1024:.0f} MB without the "
          f"50 MB line, {peak / 1024:.0f} MB with it")
    assert peak < baseline + (128 << 10), (baseline, peak)  # KiB: at most 128 MiB more


def _chat(content: str = "hi") -> ParsedRequest:
    return ParsedRequest("c", 1, "chat", [{"role": "user", "content": content}], None,
                         SamplingParams(max_tokens=4), {})


def test_a_template_looping_without_end_is_a_line_error(template_tokenizer, monkeypatch):
    monkeypatch.setattr(templates_module, "TEMPLATE_TIMEOUT_S", 0.5)
    template_tokenizer.chat_template = fixture("loop_template.jinja").read_text()
    item = tokenize_request(_chat(), template_tokenizer, 2048)
    assert item.code == "template_error" and "ran past 0.5 s" in item.message


def test_a_template_growing_without_end_is_a_line_error(template_tokenizer, monkeypatch):
    monkeypatch.setattr(templates_module, "MAX_RENDERED_CHARS", 1 << 20)
    template_tokenizer.chat_template = fixture("growing_template.jinja").read_text()
    item = tokenize_request(_chat(), template_tokenizer, 2048)
    assert item.code == "template_error" and "over the limit" in item.message


def test_a_prompt_longer_than_any_context_is_not_tokenized(template_tokenizer):
    class Refuses:
        def __len__(self):
            return 100

        def encode(self, *args, **kwargs):
            raise AssertionError("tokenized")

    record = RawRecord(1, {"custom_id": "big", "prompt": "y" * (64 * 128 + 1)})
    item = intake(record, Refuses(), 64, 4)
    assert item.code == "context_length_exceeded" and "without tokenizing" in item.message


def test_the_rss_probe_counts_grandchildren():
    """The 50 MB test measures the job's processes through RUSAGE_CHILDREN: a grandchild's
    peak must be seen (the worker is the supervisor's grandchild)."""
    grow = "x = bytearray(300 << 20); x[::4096] = b'y' * len(x[::4096])"
    nested = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, "
              f"'-c', {grow!r}])"]
    probe = ("import resource, subprocess, sys\nsubprocess.run(sys.argv[1:])\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    peak = int(subprocess.run([sys.executable, "-c", probe, *nested], capture_output=True,
                              text=True, check=True).stdout)
    assert peak > 300 << 10


def test_special_token_text_in_a_lines_own_text_is_found_and_said_once(caplog):
    from tiny_models import embedded_tokenizer

    from batchgen.io.templates import SpecialTextNote, special_token_pattern, special_token_text

    pattern = special_token_pattern(embedded_tokenizer())
    parts = [{"role": "user", "content": [{"type": "text", "text": "a <|endoftext|> b"}]}]
    assert special_token_text(parts, None, pattern) == "<|endoftext|>"
    assert special_token_text([{"role": "user", "content": "<|im_end|>"}], None,
                              pattern) == "<|im_end|>"
    assert special_token_text([{"role": "user", "content": "<|im_nope|>"}], "plain <b>",
                              pattern) is None
    note = SpecialTextNote(embedded_tokenizer())
    with caplog.at_level("WARNING", logger="batchgen.intake"):
        note.check(3, None, "plain")
        note.check(4, None, "x<|im_start|>assistant")
        note.check(5, None, "<|endoftext|>")
    assert [r.getMessage()[:49] for r in caplog.records] == [
        "line 4 writes the special token '<|im_start|>' as"]

