"""batchgen/detokenizer.py is the one place token ids become text: the engine's stop checks
and final texts, the logprobs' token names and the reasoning parser all decode through it."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import embedded_tokenizer, tiny_config

from batchgen.config import OutputConfig
from batchgen.core import (Completion, FinishedRequest, FinishReason, SamplingParams,
                           TokenLogprob)
from batchgen.detokenizer import Detokenizer, token_bytes
from batchgen.engine.stops import StopChecker
from batchgen.io.parsers import count_reasoning_tokens
from batchgen.sched.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1] / "batchgen"


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def test_text_markup_and_newest(tok):
    ids = tok.encode("<|im_start|>Party 🎉 time", add_special_tokens=False)
    skip, keep = Detokenizer(tok), Detokenizer(tok, skip_special_tokens=False)
    assert skip.text(ids) == tok.decode(ids, skip_special_tokens=True)
    assert keep.text(ids) == skip.markup(ids) == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in skip.markup(ids) and "<|im_start|>" not in skip.text(ids)
    for end in range(2, len(ids) + 1):
        text, new_from = skip.newest(ids[:end])
        assert text == tok.decode(ids[:end], skip_special_tokens=True)
        assert new_from == len(tok.decode(ids[:end - 1], skip_special_tokens=True)
                               .rstrip("\ufffd"))


def test_labels_name_partial_characters_by_their_bytes_and_are_cached(tok, monkeypatch):
    detok = Detokenizer(tok)
    ids = tok.encode("😀 日本", add_special_tokens=False)
    labels = [detok.label(i) for i in ids]
    assert any(label.startswith("bytes:\\x") for label in labels)
    assert all("\ufffd" not in label for label in labels)
    whole = tok.encode("time", add_special_tokens=False)[0]
    assert detok.label(whole) == tok.decode([whole])
    assert token_bytes("<0xE3>") == b"\xe3" and token_bytes("") is None
    calls = []
    monkeypatch.setattr(tok, "decode", lambda *a, **k: calls.append(a) or "x", raising=False)
    assert [detok.label(i) for i in ids] == labels and not calls  # cached per token id


class Spy(Detokenizer):
    """Records which of its methods ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def text(self, token_ids):
        self.calls.append("text")
        return super().text(token_ids)

    def markup(self, token_ids):
        self.calls.append("markup")
        return super().markup(token_ids)

    def newest(self, tail):
        self.calls.append("newest")
        return super().newest(tail)

    def label(self, token_id):
        self.calls.append("label")
        return super().label(token_id)


def test_stops_use_the_detokenizer_they_are_given(tok):
    spy = Spy(tok)
    checker = StopChecker(spy)
    assert checker.detokenizer is spy
    ids = tok.encode("Once upon a time", add_special_tokens=False)
    seq = Sequence(0, "r", 0, [1, 2] + ids, 2, SamplingParams(stop=("upon",)), 0)
    found = checker.match(seq)
    assert found is None and spy.calls[0] == "newest"
    spy.calls.clear()
    seq = Sequence(0, "r", 0, [1, 2] + ids[:2], 2, SamplingParams(stop=("upon",)), 0)
    found = checker.match(seq)
    assert found is not None and checker.final_text(seq, found) == "Once "
    assert spy.calls[0] == "newest" and spy.calls[-1] == "text"  # newest() decodes by text()
    # given a tokenizer, the checker decodes through a Detokenizer of its own
    assert isinstance(StopChecker(tok, skip_special_tokens=False).detokenizer, Detokenizer)


def test_logprobs_and_reasoning_decode_through_the_formatters_detokenizer(tok):
    from batchgen.io.intake import PendingRequest
    from batchgen.runner.worker.outputs import OutputFormatter

    loaded = SimpleNamespace(tokenizer=tok, name="m", hf_config=tiny_config("qwen3"))
    spec = SimpleNamespace(config=SimpleNamespace(output=OutputConfig(parse_thinking=True)),
                           batch_id="b", created=1, system_fingerprint=None)
    formatter = OutputFormatter(spec, loaded)
    spy = Spy(tok, formatter.detokenizer.skip_special)
    formatter.detokenizer = spy
    ids = tok.encode("<think>a b</think>answer", add_special_tokens=False)
    pending = PendingRequest("c", 1, "chat", [{"role": "user", "content": "q"}], None,
                             SamplingParams(logprobs=True, top_logprobs=1), {}, [5, 6])
    done = FinishedRequest("c", 2, [Completion(0, ids, FinishReason.STOP, tok.decode(ids),
                                               [TokenLogprob(t, -0.1, [(t, -0.1)]) for t in ids])])
    line = formatter.success(pending, done)
    message = line["response"]["body"]["choices"][0]["message"]
    assert message["content"] == "answer"
    assert "label" in spy.calls and "markup" in spy.calls  # logprobs, reasoning tokens
    assert count_reasoning_tokens(ids, spy, "qwen3") > 0


def test_no_module_decodes_tokens_but_the_detokenizer():
    """A tokenizer's decode / convert_ids_to_tokens is called in batchgen/detokenizer.py only."""
    pattern = re.compile(r"convert_ids_to_tokens|\.decode\([^)]*skip_special_tokens"
                         r"|tokenizer\.decode\(")
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if p.name != "detokenizer.py" and pattern.search(p.read_text())]
    assert offenders == []
