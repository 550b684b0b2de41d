"""SamplingParams are checked once, when made: intake's parse refuses a bad line with the
message users see, a library user of Engine gets the same ValueError at construction, and the
engine trusts the params it is handed (no second check)."""

from __future__ import annotations

import pytest

from batchgen.core import Request, SamplingParams
from batchgen.io.intake import IntakeError, parse_record
from batchgen.io.reader import RawRecord


@pytest.mark.parametrize("fields, message", [
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens must be <= max_tokens"),
    ({"stop": tuple("abcdefghijklmnopq")}, "stop holds at most 16 strings"),
    ({"seed": 2**63}, "seed must be in [-2^63, 2^63)"),
    ({"seed": -2**63 - 1}, "seed must be in [-2^63, 2^63)"),
])
def test_invalid_params_cannot_be_made(fields, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields)
    assert str(err.value) == message


def test_intake_reports_the_refusal_as_the_lines_error():
    line = {"custom_id": "a", "prompt": "hi", "top_p": 0.0}
    err = parse_record(RawRecord(3, line))
    assert isinstance(err, IntakeError) and err.param == "top_p"
    assert err.message == "line 3: top_p must be in (0, 1], got 0.0"
    err = parse_record(RawRecord(4, {"prompt": "hi", "max_completion_tokens": 2,
                                     "min_tokens": 5}))
    assert err.param == "min_tokens"
    assert err.message == ("line 4: min_tokens must be <= max_tokens (2, the line's "
                           "max_completion_tokens), got 5")
    # a line without max_tokens is bounded by --max-tokens, which it never wrote: named so
    err = parse_record(RawRecord(5, {"prompt": "hi", "min_tokens": 300}))
    assert err.message == ("line 5: min_tokens must be <= max_tokens (256, the job's "
                           "--max-tokens: the line sets no max_tokens), got 300")
    err = parse_record(RawRecord(6, {"prompt": "hi", "max_tokens": 3, "min_tokens": 5}))
    assert err.message == ("line 6: min_tokens must be <= max_tokens (3, the line's "
                           "max_tokens), got 5")


def _counting(monkeypatch) -> list[SamplingParams]:
    checked: list[SamplingParams] = []
    check = SamplingParams.__post_init__

    def counted(self):
        checked.append(self)
        check(self)

    monkeypatch.setattr(SamplingParams, "__post_init__", counted)
    return checked


def test_a_line_is_checked_once_from_intake_to_the_engine(tmp_path, monkeypatch):
    from engine_utils import load_ours, make_engine
    from tiny_models import save_tiny_chat_model

    engine = make_engine(load_ours(save_tiny_chat_model(tmp_path / "m")))
    checked = _counting(monkeypatch)
    parsed = parse_record(RawRecord(1, {"custom_id": "a", "prompt": [1, 2, 3], "max_tokens": 4,
                                        "temperature": 0.5}))
    assert len(checked) == 1
    engine.add_request(Request("a", list(parsed.prompt), parsed.sampling))
    assert len(checked) == 1  # the engine trusts what it is handed
    finished = [f for _ in range(40) if engine.has_unfinished() for f in engine.step()]
    assert len(finished[0].completions[0].token_ids) == 4
    assert len(checked) == 1
