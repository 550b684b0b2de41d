"""Input streaming: JSONL and Parquet records, per-line errors, file-level errors, scan."""

import gzip
import hashlib
import os
import re
import tracemalloc
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.reader import (InputFileError, RawRecord, detect_format, iter_keys,
                                read_records, record_key, scan_input)

DATA = Path(__file__).parent / "data"
MIXED = DATA / "mixed.jsonl"


def write_jsonl(path: Path, objs) -> Path:
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs))
    return path


def test_mixed_jsonl_records_and_line_numbers():
    records = list(read_records(MIXED))
    assert [r.line for r in records] == [1, 2, 4, 5, 7, 8, 9, 10]  # blank lines 3, 6 skipped
    by_line = {r.line: r for r in records}
    assert by_line[1].data["custom_id"] == "chat-1" and by_line[1].error is None
    assert by_line[7].error.code == "invalid_json" and by_line[7].data is None
    assert by_line[8].error.code == "invalid_utf8" and "line 8" in by_line[8].error.message
    assert by_line[9].error.code == "not_an_object" and "a JSON array" in by_line[9].error.message
    assert by_line[10].error is None  # an unsupported url is intake's business


@pytest.mark.parametrize("value, kind", [
    ("null", "JSON null"), ("[1]", "a JSON array"), ('"x"', "a JSON string"),
    ("4", "a JSON number"), ("1.5", "a JSON number"), ("true", "JSON true")])
def test_a_line_that_is_no_object_is_named_in_jsons_words(tmp_path, value, kind):
    """A line holding another JSON value is named as JSON names it, not as Python does
    ("NoneType", "list", "str")."""
    path = tmp_path / "in.jsonl"
    path.write_text(value + '\n{"prompt": "x"}\n')  # a file of such lines only is refused
    record, _ = read_records(path)
    assert record.error.message == (f"line 1 is {kind}, not an object: each line must be one "
                                    "JSON object ({...})")


def test_keys_default_to_line_number():
    keys = dict(iter_keys(MIXED))
    assert keys[1] == "chat-1" and keys[4] == "line-4" and keys[7] == "line-7"
    assert record_key(RawRecord(3, {"custom_id": 12})) == "12"  # integer ids (Parquet)
    assert record_key(RawRecord(3, {"custom_id": ""})) == "line-3"
    assert record_key(RawRecord(3, {"custom_id": True})) == "line-3"


def test_bom_and_missing_final_newline(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n\n{"prompt": "b"}')
    records = list(read_records(path))
    assert [(r.line, r.data) for r in records] == [(1, {"prompt": "a"}), (3, {"prompt": "b"})]


def test_a_line_bound_past_what_a_read_can_take_reads_every_line(tmp_path):
    """--max-line-bytes 9223372036854775807 is an integer below 2**63, as run's check asks,
    but one more is past what a file read takes (an OverflowError traceback)."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n')
    for bound in (2**63 - 1, 10**20):
        assert [r.data for r in read_records(path, bound)] == [{"prompt": "a"}, {"prompt": "b"}]


def test_files_joined_with_their_byte_order_marks_read_as_one(tmp_path):
    """`cat a.jsonl b.jsonl` of files a Windows editor saved: each line starting with a BOM was
    an invalid_json error line, a BOM-only line too (a request that was none)."""
    bom = b"\xef\xbb\xbf"
    path = tmp_path / "in.jsonl"
    path.write_bytes(bom + b'{"prompt": "a"}\r\n' + bom + b'{"prompt": "b"}\r\n' + bom + b"\r\n")
    records = list(read_records(path))
    assert [(r.line, r.data, r.error) for r in records] == [
        (1, {"prompt": "a"}, None), (2, {"prompt": "b"}, None)]


def test_parquet_rows_structs_json_strings_and_nulls(tmp_path):
    path = tmp_path / "in.parquet"
    table = pa.table({
        "custom_id": ["a", "b", None],
        "messages": [[{"role": "user", "content": "hi", "name": None}],
                     [{"role": "user", "content": "yo", "name": "bob"}], None],
        "prompt": [None, None, "complete me"],
        "temperature": [0.5, float("nan"), None],
        "max_tokens": [3, None, 9],
    })
    pq.write_table(table, path, row_group_size=2)
    records = list(read_records(path))
    assert [r.line for r in records] == [1, 2, 3]
    first, second, third = (r.data for r in records)
    assert first["messages"][0]["role"] == "user" and first["temperature"] == 0.5
    assert "temperature" not in second  # NaN means "not given"
    assert "custom_id" not in third and third["prompt"] == "complete me"
    assert record_key(records[2]) == "line-3"
    assert detect_format(path) == "parquet"


def test_a_parquet_file_of_embedding_inputs_alone_is_read(tmp_path):
    """An `input` column (plain embeddings rows) is a request column on its own."""
    path = tmp_path / "emb.parquet"
    pq.write_table(pa.table({"custom_id": ["d1", "d2"], "input": [["a", "b"], ["c"]]}), path)
    assert [r.data for r in read_records(path)] == [{"custom_id": "d1", "input": ["a", "b"]},
                                                   {"custom_id": "d2", "input": ["c"]}]


def test_parquet_with_jsonl_extension_is_read_as_parquet(tmp_path):
    path = tmp_path / "odd.jsonl"
    pq.write_table(pa.table({"prompt": ["x"]}), path)
    assert [r.data for r in read_records(path)] == [{"prompt": "x"}]


@pytest.mark.parametrize("make, needle", [
    (lambda p: p / "nope.jsonl", "does not exist"),
    (lambda p: p, "is a directory"),
    (lambda p: (p / "x.parquet").write_bytes(b'{"a":1}\n') and p / "x.parquet", "not a Parquet"),
    (lambda p: (p / "x.gz").write_bytes(gzip.compress(b'{"a":1}\n')) and p / "x.gz", "gunzip"),
    (lambda p: (p / "y.jsonl").write_bytes(gzip.compress(b'{"a":1}\n')) and p / "y.jsonl",
     "gunzip"),
    (lambda p: (p / "x.bin").write_bytes(b"\x00\x01binary") and p / "x.bin", "neither JSONL"),
    (lambda p: (p / "q.txt").write_bytes(b"What is 2+2?\n\nName a colour.\n") and p / "q.txt",
     "plain text, not JSONL (one JSON object per line, such as {\"custom_id\": \"q1\", "
     "\"prompt\": \"...\"}): if each line is a prompt, convert it with jq -Rc 'select(length > "
     "0) | {prompt: .}' q.txt > q.prompts.jsonl"),
    (lambda p: (p / "q.jsonl").write_bytes(b"What is 2+2?\n") and p / "q.jsonl", "plain text"),
    (lambda p: (p / "s.jsonl").write_bytes(b'"What is 2+2?"\n"Hi"\n') and p / "s.jsonl",
     "holds JSON strings, one per line, not request objects: make each one a prompt, e.g. "
     "jq -c '{prompt: .}' s.jsonl > s.prompts.jsonl"),
    (lambda p: (p / "a.json").write_bytes(b'[\n  {"prompt": "x"}\n]\n') and p / "a.json",
     "jq -c '.[]'"),
    (lambda p: (p / "b.jsonl").write_bytes(b'[{"prompt": "x"}, {"prompt": "y"}]') and p / "b.jsonl",
     "a JSON array, not JSONL"),
    (lambda p: (p / "c.json").write_bytes(b'{\n  "prompt": "x"\n}\n') and p / "c.json",
     "pretty-printed"),
    (lambda p: (p / "d.jsonl").write_bytes('{"prompt": "x"}\n'.encode("utf-16")) and p / "d.jsonl",
     "UTF-16"),
    (lambda p: pq.write_table(pa.table({"text": ["x"]}), p / "e.parquet") or p / "e.parquet",
     "none of the columns body, input, messages, prompt (it has text)"),
])
def test_file_level_errors_name_path_and_fix(tmp_path, make, needle):
    path = make(tmp_path)
    with pytest.raises(InputFileError) as info:
        list(read_records(path))
    assert needle in str(info.value) and str(path) in str(info.value)


def test_a_long_stray_first_line_does_not_refuse_the_lines_after_it(tmp_path):
    """A 5 KB comment line cut by the first read was judged alone: plain text, the whole file
    refused. It is one line's error; a file whose first line outgrows the read is judged
    line by line too, unless its bytes are binary."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"# " + b"x" * 5000 + b'\n{"prompt": "x"}\n')
    records = list(read_records(path))
    assert records[0].error.code == "invalid_json" and records[1].data == {"prompt": "x"}
    path.write_bytes(b"# " + b"x" * (70 << 10) + b'\n{"prompt": "x"}\n')
    assert list(read_records(path))[1].data == {"prompt": "x"}
    path.write_bytes(b"\x00\x01" * (40 << 10) + b'\n{"prompt": "x"}\n')
    with pytest.raises(InputFileError, match="binary"):
        list(read_records(path))


def test_a_file_with_one_object_among_its_first_lines_is_jsonl(tmp_path):
    """Only a file none of whose first lines is an object is refused whole: a bad first line
    of a JSONL file is that line's error, the others run."""
    path = tmp_path / "in.txt"
    path.write_bytes(b'oops, a stray line\n{"prompt": "x"}\n')
    records = list(read_records(path))
    assert records[0].data is None and records[1].data == {"prompt": "x"}
    long_line = tmp_path / "long.jsonl"  # the head cut inside its first object
    long_line.write_bytes(b'{"prompt": "' + b"y" * 10000 + b'"}\n')
    assert [len(r.data["prompt"]) for r in read_records(long_line)] == [10000]


def test_a_pipe_is_refused_as_input(tmp_path):
    """A job reads its input twice, and again on resume: a FIFO would read empty after the
    scan (the job "done" with 0 requests)."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match="not a regular file"):
        scan_input(fifo)  # before opening it: with no writer, opening would block


def test_numeric_custom_ids_keep_their_digits_or_are_refused(tmp_path):
    """Integers past 2**53 that JSON parsed as floats lost digits: not an id."""
    path = tmp_path / "ids.jsonl"
    path.write_bytes(b'{"custom_id": 9007199254740993, "prompt": "a"}\n'
                     b'{"custom_id": 1000000000000000000000000000000, "prompt": "b"}\n'
                     b'{"custom_id": 4.0, "prompt": "c"}\n')
    assert [record_key(r) for r in read_records(path)] == ["9007199254740993", "line-2", "4"]


def test_unknown_extension_with_json_content_is_jsonl(tmp_path):
    path = tmp_path / "requests.txt"
    path.write_bytes(b'  {"prompt": "x"}\n')
    assert detect_format(path) == "jsonl"


def test_truncated_parquet_is_a_file_error(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["x"] * 10}), path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(InputFileError, match="cannot open Parquet"):
        list(read_records(path))


def test_damaged_parquet_page_is_a_file_error(tmp_path):
    """An intact footer over a corrupt data page (a bad copy): the scan stops with the path and
    the fix before any weights load, not a traceback."""
    path = tmp_path / "bad.parquet"
    rows = 3000
    pq.write_table(pa.table({"custom_id": [f"g{i}" for i in range(rows)],
                             "prompt": [f"p{i}" for i in range(rows)]}), path,
                   compression="snappy")
    meta = pq.read_metadata(path).row_group(0).column(1)
    start = meta.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + 20:start + 220] = bytes(range(200))  # the page body, past its header
    path.write_bytes(bytes(data))
    with pytest.raises(InputFileError, match="damaged"):
        scan_input(path)


def test_a_damaged_page_header_is_named_on_one_line(tmp_path):
    """pyarrow's message for a page header that does not decode spans lines ("...over 10
    bytes.\nDeserializing page header failed.\n"): the error stays one line."""
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"custom_id": ["a", "b"], "input": ["x", "y"]}), path)
    start = pq.read_metadata(path).row_group(0).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[start:start + 40] = b"\xff" * 40
    path.write_bytes(bytes(data))
    with pytest.raises(InputFileError, match="damaged") as err:
        scan_input(path)
    assert "\n" not in str(err.value) and ".;" not in str(err.value), str(err.value)


def test_parquet_float_ids_and_nan_in_structs(tmp_path):
    """pandas writes an integer column with a gap as floats, and NaN for a missing number
    inside a struct: whole-number ids keep their digits, NaN fields are "not given"."""
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"custom_id": [1.0, None, 3.0],
                             "body": [{"prompt": "a", "temperature": float("nan")},
                                      {"prompt": "b", "temperature": 0.5},
                                      {"prompt": "c", "temperature": 1.0}]}), path)
    records = list(read_records(path))
    assert [record_key(r) for r in records] == ["1", "line-2", "3"]
    assert records[0].data["body"] == {"prompt": "a"}


def test_scan_summary(tmp_path):
    summary = scan_input(MIXED)
    assert summary.sha256 == hashlib.sha256(MIXED.read_bytes()).hexdigest()
    assert summary.records == 8 and summary.format == "jsonl"
    assert summary.line_errors == {"invalid_json": 1, "invalid_utf8": 1, "not_an_object": 1}
    assert summary.size_bytes == MIXED.stat().st_size


def test_scan_refuses_duplicate_custom_id_naming_both_lines(tmp_path):
    objs = [{"custom_id": f"id-{i}", "prompt": "x"} for i in range(50)]
    objs.insert(30, {"custom_id": "id-7", "prompt": "again"})
    path = write_jsonl(tmp_path / "dup.jsonl", objs)
    with pytest.raises(InputFileError) as info:
        scan_input(path)
    assert "'id-7'" in str(info.value) and "line 8" in str(info.value)
    assert "line 31" in str(info.value)


def test_scan_duplicate_between_explicit_and_generated_id(tmp_path):
    objs = [{"prompt": "x"}, {"custom_id": "line-1", "prompt": "y"}]
    path = write_jsonl(tmp_path / "d.jsonl", objs)
    with pytest.raises(InputFileError, match="line 1 and line 2"):
        scan_input(path)


def test_scan_duplicates_in_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"custom_id": ["a", "b", "a"], "prompt": ["1", "2", "3"]}), path)
    with pytest.raises(InputFileError, match="line 1 and line 3"):
        scan_input(path)


def test_empty_file_scans_to_zero(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"\n\n")
    assert scan_input(path).records == 0


def test_100k_lines_scanned_and_read_with_bounded_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        for i in range(100_000):
            f.write(orjson.dumps({"custom_id": f"request-{i:06d}", "messages": [
                {"role": "user", "content": f"question number {i} " + "pad " * 20}]}) + b"\n")
    assert path.stat().st_size > 10_000_000
    tracemalloc.start()
    try:
        summary = scan_input(path)
        count = sum(1 for _ in read_records(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary.records == count == 100_000
    assert peak < 8_000_000, f"peak {peak} bytes: the reader must stream"


@pytest.mark.parametrize("value, fix", [
    ("NaN", "write null"), ("-Infinity", "write null"), ("1e400", "finite number"),
    ('"\\ud83d cut"', "surrogate pair"), ("[" * 1100 + "]" * 1100, "flatten")])
def test_invalid_json_names_the_column_not_line_1_and_the_fix(tmp_path, value, fix):
    """What Python's json.dumps writes (NaN, lone surrogates) and JSON does not allow: the
    message said `line 3 ... line 1 column 43` and no fix."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"custom_id": "é", "prompt": "x", "temperature": '
                    f"{value}}}\n")
    [_, bad] = read_records(path)
    assert bad.error.code == "invalid_json" and bad.line == 3
    assert re.match(r"line 3 is not valid JSON at column \d+: ", bad.error.message)
    assert "line 1" not in bad.error.message and fix in bad.error.message


@pytest.mark.parametrize("tail, fix", [
    (b'{"custom_id": "c", "prompt": "cut', "the file ends inside this line"),
    (b'{"custom_id": "c",\r\n  "prompt": "x"}\n', "write each object on one line"),
    (b'{"prompt": "x"}{"prompt": "y"}\n', "put each object on its own line"),
    (b'{"prompt": "x"}\r{"prompt": "y"}\r', "tr '\\r' '\\n'")])
def test_a_line_ending_before_its_json_names_the_fix(tmp_path, tail, fix):
    """A file cut off mid-line (a copy that did not finish) said only `unexpected end of
    data`, two objects on a line (or lines ending in a lone CR) `unexpected content after
    document`: neither what happened nor what to do."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n' + tail)
    [_, bad, *_] = read_records(path)
    assert bad.error.code == "invalid_json" and bad.line == 3
    assert fix in bad.error.message, bad.error.message


def test_the_second_half_of_a_wrapped_object_is_named_a_continuation(tmp_path):
    """An OpenAI line wrapped over two lines (as a docs page or an editor shows it): the second
    half, `"body": {...}}`, was told "a second JSON value follows the first on this line: put
    each object on its own line", which describes neither the line nor the fix."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"custom_id": "q1", "method": "POST", "url": "/v1/completions",\n'
                     b' "body": {"prompt": "Once"}}\n')
    [first, second] = read_records(path)
    assert "write each object on one line" in first.error.message
    assert second.error.code == "invalid_json" and second.line == 2
    assert "continues an object begun on an earlier line" in second.error.message
    assert "write each object on one line (jq -c)" in second.error.message
    assert "second JSON value" not in second.error.message


def test_parquet_decimal_and_binary_cells_are_numbers_and_text(tmp_path):
    """SQL engines type `0.7 AS temperature` as DECIMAL(1,1), Hive-era writers store strings as
    BINARY without the UTF8 annotation: both were refused as "must be a number" / "must be a
    string" though they hold exactly that."""
    from decimal import Decimal

    from batchgen.io.intake import ParsedRequest, parse_record

    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "custom_id": pa.array([Decimal(7), Decimal(8), Decimal(9)], pa.decimal128(20, 0)),
        "prompt": pa.array([b"Once", "caf\u00e9".encode(), b"\xff"], pa.binary()),
        "temperature": pa.array([Decimal("0.7"), None, None], pa.decimal128(1, 1)),
        "max_tokens": pa.array([Decimal(4), None, None], pa.decimal128(10, 0))}), path)
    first, second, third = read_records(path)
    parsed = parse_record(first)
    assert isinstance(parsed, ParsedRequest), parsed
    assert (parsed.custom_id, parsed.prompt) == ("7", "Once")
    assert parsed.sampling.temperature == 0.7 and parsed.sampling.max_tokens == 4
    assert parse_record(second).prompt == "caf\u00e9"
    assert third.error.code == "invalid_utf8" and "'prompt'" in third.error.message
    assert record_key(third) == "9"  # its own custom_id cell is readable: its error names it


def test_parquet_decimal_and_binary_items_of_list_columns_are_numbers_and_text(tmp_path):
    """A messages column of structs with BINARY fields (Hive, Spark) and a list of decimals
    were left as bytes and Decimals: `role must be a non-empty string`, `stop_token_ids[0]
    must be a token id`."""
    from decimal import Decimal

    from batchgen.io.intake import ParsedRequest, parse_record

    path = tmp_path / "in.parquet"
    message = pa.struct([("role", pa.binary()), ("content", pa.binary()), ("name", pa.string())])
    pq.write_table(pa.table({
        "custom_id": ["a", "b"],
        "messages": pa.array([[{"role": b"user", "content": "caf\u00e9".encode()}],
                              [{"role": b"user", "content": b"\xff"}]], pa.list_(message)),
        "stop_token_ids": pa.array([[Decimal(5)], None], pa.list_(pa.decimal128(10, 0)))}),
        path)
    first, second = read_records(path)
    parsed = parse_record(first)
    assert isinstance(parsed, ParsedRequest), parsed
    assert parsed.messages == [{"role": "user", "content": "caf\u00e9"}]
    assert list(parsed.sampling.stop_token_ids) == [5]
    assert second.error.code == "invalid_utf8" and "'messages'" in second.error.message
    error = parse_record(second)
    assert (error.custom_id, error.code) == ("b", "invalid_utf8")


def test_a_parquet_file_with_two_columns_of_one_name_is_refused(tmp_path):
    """pyarrow writes them; a row read as a dict silently kept the last one."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["x"]), pa.array(["y"])],
                                        names=["custom_id", "prompt", "prompt"]), path)
    with pytest.raises(InputFileError, match="more than one column named 'prompt'"):
        list(read_records(path))


def test_a_duplicate_with_a_generated_line_id_says_where_that_id_came_from(tmp_path):
    """`custom_id 'line-1' appears on line 1` read as nonsense where line 1 holds no custom_id
    (or is not JSON at all): its result is named line-1."""
    path = tmp_path / "in.jsonl"
    path.write_text('{not json\n{"custom_id": "line-1", "prompt": "y"}\n')
    with pytest.raises(InputFileError) as refused:
        scan_input(path)
    said = str(refused.value)
    assert "on line 1 and line 2 (line 1 has no usable custom_id of its own" in said
    write_jsonl(path, [{"custom_id": "a", "prompt": "x"}, {"custom_id": "a", "prompt": "y"}])
    with pytest.raises(InputFileError, match=r"line 1 and line 2; custom_ids must be unique"):
        scan_input(path)


def test_a_duplicate_custom_id_megabytes_long_is_quoted_in_part(tmp_path):
    """The refusal echoed the whole id: a 1 MB custom_id made a 1 MB error line."""
    path = tmp_path / "in.jsonl"
    write_jsonl(path, [{"custom_id": "x" * 1_000_000, "prompt": "a"}] * 2)
    with pytest.raises(InputFileError, match=r"line 1 and line 2; custom_ids must be unique") \
            as refused:
        scan_input(path)
    assert len(str(refused.value)) < 300
