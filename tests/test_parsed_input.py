"""The input is parsed once: the supervisor's scan parses and checks every line and stores it
(io/parsed_input.py); workers tokenize their shard of the stored records, resume and the final
merge read the stored custom_ids. No line is decoded or checked a second time."""

from __future__ import annotations

import pickle
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from tiny_models import embedded_tokenizer

from batchgen.config import JobConfig, StorageConfig
from batchgen.io import intake as intake_module
from batchgen.io import reader as reader_module
from batchgen.core import SamplingParams
from batchgen.io.intake import IntakeError, ParsedRequest, PendingRequest, parse_record
from batchgen.io.parsed_input import (HEADER, ParsedRecord, parse_input, parsed_keys,
                                      read_parsed)
from batchgen.io.templates import SpecialTextNote
from batchgen.io.reader import InputFileError, identify_input, read_records, record_key

LINES = [
    {"custom_id": "a", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5},
    {"custom_id": "bad", "messages": "not a list"},
    "",  # a blank line keeps its number
    {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.5},
    "{not json",
    {"custom_id": "c", "prompt": "x", "top_p": 0.0},
    {"custom_id": "emb", "input": "embed me"},
    {"custom_id": "d", "prompt": [1, 2, 3], "n": 2, "max_tokens": 3},
]


def write_input(path: Path, lines=LINES) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else orjson.dumps(line).decode()).encode()
                    + b"\n")
    return path


def test_stored_records_are_what_parse_record_makes(tmp_path):
    inp = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "job.requests"
    summary = parse_input(identify_input(inp), out, 1 << 20, 16)
    assert summary.records == 7 and summary.line_errors == {"invalid_json": 1}
    assert summary.sha256 == identify_input(inp).sha256
    expected = [(r.line, record_key(r), parse_record(r, 16)) for r in read_records(inp)]
    got = [(r.line, r.key, r.item) for r in read_parsed(out)]
    assert got == expected
    assert list(parsed_keys(out)) == [(line, key) for line, key, _ in expected]
    errors = {r.key: r.item for r in read_parsed(out) if isinstance(r.item, IntakeError)}
    assert set(errors) == {"bad", "line-5", "c"}
    assert errors["c"].message == "line 6: top_p must be in (0, 1], got 0.0"
    for world in (2, 3):  # data-parallel shards: disjoint, complete, equal, in input order
        shards = [list(read_parsed(out, rank, world)) for rank in range(world)]
        assert sorted(r.line for s in shards for r in s) == [line for line, _, _ in expected]
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        assert all([r.line for r in s] == sorted(r.line for r in s) for s in shards)


def test_the_scan_counts_the_requests_that_take_the_default_max_tokens(tmp_path):
    """Those decide whether --max-tokens may change on a resume (runner/files/job.py)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    lines = LINES + [
        {"custom_id": "e1", "url": "/v1/chat/completions", "body": dict(chat)},
        {"custom_id": "e2", "url": "/v1/chat/completions",
         "body": {**chat, "max_completion_tokens": 9}},
        {"custom_id": "e3", "prompt": "x", "max_tokens": None},
        {"custom_id": "e4", "url": "/v1/embeddings", "body": {"input": "x"}},
        # Parquet may hold the body as JSON text: it sets its own max_tokens
        {"custom_id": "e5", "url": "/v1/completions", "body": '{"prompt": "x", "max_tokens": 3}'},
        {"custom_id": "e6", "url": "/v1/completions", "body": '{"prompt": "x"}'}]
    inp = write_input(tmp_path / "in.jsonl", lines)
    summary = parse_input(identify_input(inp), tmp_path / "job.requests", 1 << 20, 16)
    assert summary.default_max_tokens_lines == 3  # e1, e3, e6; errors and embeddings none
    inp = write_input(tmp_path / "given.jsonl")  # LINES: every request sets max_tokens
    assert parse_input(identify_input(inp), tmp_path / "given.requests", 1 << 20,
                       16).default_max_tokens_lines == 0


def test_replicas_take_requests_that_share_a_system_prompt_together(tmp_path):
    """Four long system prompts over 32 shuffled chat lines, four replicas: each replica gets
    the eight lines of one system prompt, so each prompt's prefix is computed once."""
    systems = [f"You are assistant {i}. " + "Follow the house style. " * 200 for i in range(4)]
    order = [i % 4 for i in range(32)]
    random.Random(2).shuffle(order)
    lines = [{"custom_id": f"q{n}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "system", "content": systems[which]},
                                    {"role": "user", "content": f"q {n}"}]}}
             for n, which in enumerate(order)]
    inp = write_input(tmp_path / "in.jsonl", lines)
    out = tmp_path / "job.requests"
    parse_input(identify_input(inp), out, 1 << 20, 16)
    for rank in range(4):
        mine = list(read_parsed(out, rank, 4))
        assert len(mine) == 8
        assert len({r.item.messages[0]["content"] for r in mine}) == 1


def test_a_duplicate_leaves_no_stored_file(tmp_path):
    inp = write_input(tmp_path / "in.jsonl", LINES + [{"custom_id": "a", "prompt": "again"}])
    out = tmp_path / "job.requests"
    with pytest.raises(InputFileError, match="custom_id 'a' appears on line 1 and line 9"):
        parse_input(identify_input(inp), out, 1 << 20, 16)
    assert not out.exists() and not list(tmp_path.glob(".job.requests*"))


def test_only_parsed_requests_are_read_back(tmp_path):
    out = tmp_path / "job.requests"
    item = pickle.dumps(SimpleNamespace(x=1))
    out.write_bytes(HEADER.pack(1, 1, len(item), bytes(12)) + b"a" + item)
    with pytest.raises(InputFileError, match="damaged"):
        list(read_parsed(out))
    out.write_bytes(HEADER.pack(1, 1, 40, bytes(12)) + b"a" + b"\x80")
    with pytest.raises(InputFileError, match="ends inside a record"):
        list(read_parsed(out))
    with pytest.raises(InputFileError, match="missing"):
        list(read_parsed(tmp_path / "none.requests"))


class _Queue(list):
    """The worker's embeddings queue: takes an embedding line (None: queued)."""

    def __init__(self, admitted: list):
        super().__init__()
        self.admitted = admitted

    def add(self, item):
        self.admitted.append(item)


def _fake_worker():
    """What Worker._intake needs of a worker: an engine taking requests, no writer."""
    admitted, lines = [], []
    fake = SimpleNamespace(
        engine=SimpleNamespace(num_requests=0), done=set(), writer=None,
        embeddings=_Queue(admitted), grammars=SimpleNamespace(request=lambda p: p.to_request()),
        special_text=SpecialTextNote(embedded_tokenizer()),
        _admit=admitted.append, stats=SimpleNamespace(failed=0),
        spec=SimpleNamespace(batch_id="b", sampling_defaults={}, config=SimpleNamespace(
            engine=SimpleNamespace(model=SimpleNamespace(max_model_len=None)))),
        loaded=SimpleNamespace(tokenizer=embedded_tokenizer(), max_context=256,
                               model=SimpleNamespace(generates=True),
                               hf_config=SimpleNamespace(vocab_size=49152)))
    return fake, admitted, lines


def test_each_line_is_parsed_once_from_the_scan_to_the_final_merge(tmp_path, monkeypatch):
    """Counts JSON decodes (reader.parse_line) and checks (intake._parse) per line across the
    supervisor's scan, two data-parallel workers' intake, resume and the merge's key order."""
    from batchgen.runner.leader import prepare, supervisor
    from batchgen.runner.worker.worker import Worker

    inp = write_input(tmp_path / "in.jsonl")
    decoded, checked = Counter(), Counter()
    parse_line, check = reader_module.parse_line, intake_module._parse

    def counted_parse_line(raw, line):
        decoded[line] += 1
        return parse_line(raw, line)

    def counted_check(data, key, line, default_max_tokens):
        checked[line] += 1
        return check(data, key, line, default_max_tokens)

    monkeypatch.setattr(reader_module, "parse_line", counted_parse_line)
    monkeypatch.setattr(intake_module, "_parse", counted_check)
    config = JobConfig(storage=StorageConfig(input=str(inp), storage_path=str(tmp_path / "s"),
                                             max_tokens=16)).validate()
    source, paths = prepare.identify(config)
    summary = prepare.parse(config, source, paths)
    assert summary.records == 7
    pending, errors = [], []
    for rank in range(2):
        fake, admitted, lines = _fake_worker()
        records = read_parsed(paths.parsed_input, rank, 2)
        assert Worker._intake(fake, records, 100, lines) is True
        pending += [r.origin for r in admitted if hasattr(r, "origin")]
        errors += [orjson.loads(line) for line in lines]
    assert sorted(p.custom_id for p in pending if isinstance(p, PendingRequest)) == [
        "a", "d", "line-4"]
    by_id = {e["custom_id"]: e["response"]["body"]["error"] for e in errors}
    assert set(by_id) == {"bad", "line-5", "c"} and by_id["c"]["line"] == 6
    assert by_id["line-5"]["code"] == "invalid_json"
    assert supervisor.done_records(paths, summary.records) == 0
    assert [key for _, key in parsed_keys(paths.parsed_input)] == [
        "a", "bad", "line-4", "line-5", "c", "emb", "d"]
    nonblank = [1, 2, 4, 5, 6, 7, 8]
    assert decoded == Counter(nonblank)  # one JSON decode per line
    assert checked == Counter(n for n in nonblank if n != 5)  # one check per JSON object


def test_stored_records_hold_values_not_field_names(tmp_path):
    """The parsed input is rewritten on every run and holds one record per input line: each
    record's fields go by position (core.CompactPickle), so a short line's record is not
    mostly the names of SamplingParams' fields (5-7x the input's size before)."""
    inp = write_input(tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "prompt": "hi"}
                                               for i in range(200)] + LINES)
    out = tmp_path / "job.requests"
    parse_input(identify_input(inp), out, 1 << 20, 16)
    stored = out.read_bytes()
    for name in ("frequency_penalty", "stop_token_ids", "top_logprobs", "custom_id",
                 "encoding_format", "dimensions", "ignore_eos"):
        assert name.encode() not in stored, name
    expected = [parse_record(r, 16) for r in read_records(inp)]
    assert [r.item for r in read_parsed(out)] == expected
    assert len(stored) / 200 < 320  # bytes per short line, all told


def test_a_resumed_worker_passes_finished_records_over_unread(tmp_path, monkeypatch):
    """A resumed job's worker skips the requests whose results are saved: it must not unpickle
    each of them to find that out (900k of a 1M-line job, twice per start)."""
    from batchgen.io import parsed_input

    inp = write_input(tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "prompt": "hi"}
                                               for i in range(50)])
    out = tmp_path / "job.requests"
    parse_input(identify_input(inp), out, 1 << 20, 16)
    loads = []
    real_load = parsed_input._load
    monkeypatch.setattr(parsed_input, "_load", lambda raw, path: loads.append(1)
                        or real_load(raw, path))
    done = {f"r{i}" for i in range(48)}
    assert [r.key for r in read_parsed(out, skip=done)] == ["r48", "r49"]
    assert len(loads) == 2
    for world in (2, 3):  # each replica's share, less the finished
        shards = [[r.key for r in read_parsed(out, rank, world, skip=done)]
                  for rank in range(world)]
        assert sorted(k for s in shards for k in s) == ["r48", "r49"]


def test_records_pickled_with_field_names_load_with_later_fields_defaulted(monkeypatch):
    """A store written before a field existed (pickled as a dict of names, as before compact
    pickling) loads with that field's default; one missing a required field is damaged."""
    from batchgen.io.parsed_input import _load

    record = ParsedRequest("c", 1, "completion", None, "hi", SamplingParams(), {})
    state = {k: v for k, v in vars(record).items() if k != "unset"}
    monkeypatch.setattr(ParsedRequest, "__getstate__", lambda self: state)
    old = pickle.dumps(record)
    del state["kind"]
    damaged = pickle.dumps(record)
    monkeypatch.undo()
    loaded = _load(old, Path("x"))
    assert loaded == record and loaded.unset == frozenset()
    with pytest.raises(InputFileError, match="damaged"):
        _load(damaged, Path("x"))


def _parse_counting(monkeypatch, inp: Path, out: Path, max_tokens: int = 16):
    """parse_input, and how many lines it decoded (0: the stored records were reused)."""
    decoded = Counter()
    parse_line = reader_module.parse_line

    def counted(raw, line):
        decoded[line] += 1
        return parse_line(raw, line)

    monkeypatch.setattr(reader_module, "parse_line", counted)
    summary = parse_input(identify_input(inp), out, 1 << 20, max_tokens)
    monkeypatch.setattr(reader_module, "parse_line", parse_line)
    return summary, sum(decoded.values())


def test_a_resume_reuses_the_stored_records_only_while_everything_matches(tmp_path, monkeypatch):
    from batchgen.io import parsed_input

    inp = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "job.requests"
    first, decoded = _parse_counting(monkeypatch, inp, out)
    assert decoded == 7 and parsed_input.stamp_of(out).is_file()
    stored = out.read_bytes()
    again, decoded = _parse_counting(monkeypatch, inp, out)
    assert decoded == 0 and again == first and out.read_bytes() == stored
    # Another --max-tokens, another input, another parser: parsed again.
    assert _parse_counting(monkeypatch, inp, out, max_tokens=17)[1] == 7
    assert _parse_counting(monkeypatch, inp, out)[1] == 7
    write_input(inp, LINES + [{"custom_id": "e", "prompt": "more"}])
    grown, decoded = _parse_counting(monkeypatch, inp, out)
    assert decoded == 8 and grown.records == 8
    assert [key for _, key in parsed_keys(out)][-1] == "e"
    monkeypatch.setattr(parsed_input, "parser_digest", lambda: "another parser")
    assert _parse_counting(monkeypatch, inp, out)[1] == 8
    monkeypatch.undo()
    assert _parse_counting(monkeypatch, inp, out)[1] == 8  # the stamp names the new digest
    assert _parse_counting(monkeypatch, inp, out)[1] == 0


@pytest.mark.parametrize("damage", ["flip", "cut", "no stamp", "stamp edited", "stamp garbage"])
def test_a_changed_store_or_stamp_is_parsed_again(tmp_path, monkeypatch, damage):
    from batchgen.io import parsed_input

    inp = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "job.requests"
    first, _ = _parse_counting(monkeypatch, inp, out)
    stored, stamp = out.read_bytes(), parsed_input.stamp_of(out)
    if damage == "flip":  # same size, one byte of a prompt changed
        at = stored.index(b"Hi there")
        out.write_bytes(stored[:at] + b"Ho" + stored[at + 2:])
    elif damage == "cut":
        out.write_bytes(stored[:-3])
    elif damage == "no stamp":
        stamp.unlink()
    elif damage == "stamp edited":
        data = orjson.loads(stamp.read_bytes())
        stamp.write_bytes(orjson.dumps({**data, "records": "many"}))
    else:
        stamp.write_bytes(b"\x00not json")
    again, decoded = _parse_counting(monkeypatch, inp, out)
    assert decoded == 7 and again == first and out.read_bytes() == stored


def test_a_reader_that_finds_the_store_damaged_removes_its_stamp(tmp_path, monkeypatch):
    from batchgen.io import parsed_input

    inp = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "job.requests"
    _parse_counting(monkeypatch, inp, out)
    stored = out.read_bytes()
    out.write_bytes(stored[:-3])
    parsed_input.stamp_of(out).write_bytes(orjson.dumps({}))  # any stamp: the reader drops it
    with pytest.raises(InputFileError, match="re-run the job"):
        list(read_parsed(out))
    assert not parsed_input.stamp_of(out).exists()
    assert _parse_counting(monkeypatch, inp, out)[1] == 7 and out.read_bytes() == stored
    parsed_input.remove_parsed(out)
    assert not out.exists() and not parsed_input.stamp_of(out).exists()


def test_parses_killed_before_their_rename_leave_no_temp_files_behind(tmp_path, monkeypatch):
    """Each kill during a parse leaves its temp file (~2x the input): the next parse removes
    them, or kills during long parses fill the disk and every run after fails (ENOSPC) before
    any cleanup."""
    from batchgen.io import parsed_input

    inp = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "job.requests"
    stale = [tmp_path / f".{out.name}.tmp-{pid}" for pid in (101, 102)]
    stale.append(tmp_path / f".{parsed_input.stamp_of(out).name}.tmp-103")
    for path in stale:
        path.write_bytes(b"x" * 1000)
    other = tmp_path / ".another_job.requests.tmp-104"
    other.write_bytes(b"y")
    assert _parse_counting(monkeypatch, inp, out)[1] == 7
    assert not any(path.exists() for path in stale) and other.exists()


def test_an_input_edited_while_parsed_is_not_stamped_for_reuse(tmp_path, monkeypatch):
    """The sha256 is taken before the parse: lines edited in between must not be stored as the
    hashed input's, or a resume on the original file answers the edited lines."""
    from batchgen.io import parsed_input

    inp = write_input(tmp_path / "in.jsonl")
    original = inp.read_bytes()
    out = tmp_path / "job.requests"
    identity = identify_input(inp)
    real = parsed_input.parse_record

    def edit_mid_parse(record, max_tokens):
        if record.line == 1:  # same size, one prompt changed, in place
            with open(inp, "r+b") as f:
                f.write(original.replace(b"Once upon", b"ONCE UPON"))
        return real(record, max_tokens)

    monkeypatch.setattr(parsed_input, "parse_record", edit_mid_parse)
    parse_input(identity, out, 1 << 20, 16)
    monkeypatch.undo()
    assert not parsed_input.stamp_of(out).exists()
    inp.write_bytes(original)  # the hashed content back: parsed again, from it
    assert identify_input(inp).sha256 == identity.sha256
    assert _parse_counting(monkeypatch, inp, out)[1] == 7
    prompts = [r.item.prompt for r in read_parsed(out) if isinstance(r.item, ParsedRequest)]
    assert "Once upon a time" in prompts and "ONCE UPON a time" not in prompts


def test_the_parse_warns_once_about_fields_that_run_with_their_defaults(tmp_path, caplog):
    """`batchgen run` names lines whose fields it does not read (validate names them all):
    a max_tokens beside an OpenAI line's body runs with the default length, a typo likewise."""
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body,
              "max_tokens": 500},
             {"custom_id": "b", "prompt": "x", "temprature": 0.2},
             *({"custom_id": f"t{i}", "prompt": "x", "max_tokenz": 3} for i in range(5)),
             {"custom_id": "fine", "prompt": "x", "max_tokens": 3, "model": "m"}]
    inp = write_input(tmp_path / "in.jsonl", lines)
    with caplog.at_level("WARNING", logger="batchgen.io.parsed_input"):
        parse_input(identify_input(inp), tmp_path / "job.requests", 1 << 20, 16)
    warned = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(warned) == 1, warned
    assert warned[0].startswith("7 lines of the input carry fields batchgen does not read")
    assert "line 1: field 'max_tokens' is outside \"body\"" in warned[0]
    assert "line 2: unknown field 'temprature': did you mean 'temperature'?" in warned[0]
    assert "; ...)" in warned[0] and f"batchgen validate -i {inp}" in warned[0]
    caplog.clear()
    write_input(tmp_path / "clean.jsonl", lines[-1:])
    with caplog.at_level("WARNING", logger="batchgen.io.parsed_input"):
        parse_input(identify_input(tmp_path / "clean.jsonl"), tmp_path / "c.requests", 1 << 20,
                    16)
    assert not [r for r in caplog.records if "does not read" in r.getMessage()]


def test_a_line_with_a_million_unknown_keys_costs_one_fuzzy_match(monkeypatch):
    """The run's hint needs the first unknown field only: a hostile line's many keys are not
    each matched against the known fields."""
    from batchgen.io import field_hints

    data = {"custom_id": "x", "prompt": "p", **{f"k{i}": 1 for i in range(200_000)}}
    calls = []
    real = field_hints.difflib.get_close_matches
    monkeypatch.setattr(field_hints.difflib, "get_close_matches",
                        lambda *a: calls.append(a) or real(*a))
    hints = field_hints.unknown_fields(data, 1)
    assert len(hints) == 1 and hints[0].startswith("unknown field 'k0'") and len(calls) == 1


def _count_fuzzy_matches(monkeypatch) -> list:
    from batchgen.io import field_hints

    calls: list = []
    real = field_hints.difflib.get_close_matches
    monkeypatch.setattr(field_hints.difflib, "get_close_matches",
                        lambda *a: calls.append(a) or real(*a))
    return calls


def test_a_column_every_line_carries_costs_a_fuzzy_match_per_line_shown_only(tmp_path,
                                                                             monkeypatch,
                                                                             caplog):
    """An extra field on every line (a Parquet file's `source` column) is counted on each line
    but named, which takes a fuzzy match costing more than parsing the line, only for the
    lines the warning shows: a million such lines parse as fast as lines without it."""
    lines = [{"custom_id": f"r{i}", "prompt": "x", "source": "wiki"} for i in range(40)]
    inp = write_input(tmp_path / "in.jsonl", lines)
    calls = _count_fuzzy_matches(monkeypatch)
    with caplog.at_level("WARNING", logger="batchgen.io.parsed_input"):
        parse_input(identify_input(inp), tmp_path / "job.requests", 1 << 20, 16)
    warned = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("40 lines of the input carry fields")
    assert "line 3: unknown field 'source'" in warned[0] and "line 4:" not in warned[0]
    assert len(calls) == 3


def test_the_parse_warning_counts_only_lines_that_run(tmp_path, caplog):
    """A line refused at intake runs with none of its fields: its unknown ones are not among
    the lines said to "run with their defaults" (validate counts them the same way)."""
    lines = [{"custom_id": "bad", "foo": 1},  # no messages or prompt: an error line
             {"custom_id": "ok", "prompt": "x", "colour": "red"}]
    inp = write_input(tmp_path / "in.jsonl", lines)
    with caplog.at_level("WARNING", logger="batchgen.io.parsed_input"):
        parse_input(identify_input(inp), tmp_path / "job.requests", 1 << 20, 16)
    warned = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("1 line of the input carries fields")
    assert "line 2: unknown field 'colour'" in warned[0] and "'foo'" not in warned[0]


def test_validate_names_the_first_lines_with_unknown_fields_and_counts_the_rest(tmp_path,
                                                                                monkeypatch):
    from batchgen.runner.leader.validate import SHOWN_WARNINGS, validate_file

    lines = [{"custom_id": f"r{i}", "prompt": "x", "source": "wiki"} for i in range(60)]
    inp = write_input(tmp_path / "in.jsonl", lines)
    calls = _count_fuzzy_matches(monkeypatch)
    assert validate_file(inp, 16) == 0
    assert len(calls) == SHOWN_WARNINGS


def test_a_long_run_of_bad_lines_is_handed_out_in_bounded_batches(monkeypatch):
    """An input of mostly refused lines: each intake pass stops at ERROR_LINES_PER_STEP error
    lines (written before it reads on) instead of holding every bad line of the file in memory
    until the engine has a request to run."""
    from batchgen.runner.worker import worker as worker_module

    monkeypatch.setattr(worker_module, "ERROR_LINES_PER_STEP", 4)
    bad = [parse_record(reader_module.RawRecord(n, {"custom_id": f"e{n}", "prompt": "x",
                                                    "max_tokens": -1})) for n in range(1, 11)]
    records = iter([ParsedRecord(r.line, r.custom_id, r) for r in bad])
    fake, admitted, _ = _fake_worker()
    passes = []
    while True:
        lines: list[bytes] = []
        exhausted = worker_module.Worker._intake(fake, records, 100, lines)
        passes.append(len(lines))
        if exhausted:
            break
    assert passes == [4, 4, 2] and not admitted and fake.stats.failed == 10


def test_a_long_parse_says_how_far_it_got(tmp_path, monkeypatch, caplog):
    """Parsing millions of lines takes minutes before the model loads: a log line every
    PARSE_LOG_INTERVAL_S says how far it got, instead of silence."""
    from batchgen.io import parsed_input

    monkeypatch.setattr(parsed_input, "PARSE_LOG_INTERVAL_S", 0.0)
    inp = write_input(tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "prompt": "hi"}
                                               for i in range(3000)])
    with caplog.at_level("INFO", logger="batchgen.job"):
        parse_input(identify_input(inp), tmp_path / "store", 1 << 20, 16)
    lines = [r.getMessage() for r in caplog.records if "parsing the input" in r.getMessage()]
    size = inp.stat().st_size
    assert lines == [f"parsing the input ({size / 1e3:.1f} kB): {n:,} records so far, to line "
                     f"{n:,}; the model loads once every line is checked" for n in (1024, 2048)]


def test_validate_of_a_long_file_says_how_far_it_got(tmp_path, monkeypatch, capsys):
    """`batchgen validate` of millions of lines: a line on stderr every PROGRESS_INTERVAL_S,
    its report on stdout unchanged."""
    from batchgen.runner.leader import validate

    monkeypatch.setattr(validate, "PROGRESS_INTERVAL_S", 0.0)
    inp = write_input(tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "prompt": "hi"}
                                               for i in range(2100)])
    assert validate.validate_file(inp, 16) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"checking {inp}: {n:,} records so far, to line {n:,}"
                                for n in (1024, 2048)]
    assert "2100 valid, 0 invalid" in out and "checking" not in out


def test_validate_says_how_many_invalid_lines_it_did_not_show(tmp_path, capsys):
    from batchgen.runner.leader import validate

    inp = write_input(tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "prompt": "hi",
                                               "max_tokens": 0} for i in range(53)])
    assert validate.validate_file(inp, 16) == 1
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if line.startswith("line ")]) == validate.SHOWN_ERRORS
    assert "... and 3 more invalid lines not shown (the first 50 are; all are counted below)" \
        in out
    assert out[-2].endswith("0 valid, 53 invalid (53 invalid sampling param)"), out[-2]
