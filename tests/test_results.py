"""Result line schema: success (chat and text completion), errors, failures, determinism."""

import orjson

from batchgen.core import (Completion, FinishedRequest, FinishReason, SamplingParams,
                           TokenLogprob)
from batchgen.io.intake import IntakeError, PendingRequest
from batchgen.io.results import (ParsedChoice, dumps, error_line, failure_line, is_success,
                                 success_line)

VOCAB = {0: "Hel", 1: "lo", 2: " wörld", 3: "!"}


def decode(token_id: int) -> str:
    return VOCAB[token_id]


def split_text(token_ids) -> tuple[str, str]:
    return "".join(VOCAB[t] for t in token_ids), ""


def pending(kind="chat", logprobs=False, top=0, n=1, custom_id="req-1"):
    sampling = SamplingParams(max_tokens=8, n=n, logprobs=logprobs, top_logprobs=top)
    messages = [{"role": "user", "content": "hi"}] if kind == "chat" else None
    prompt = "hi" if kind == "completion" else None
    return PendingRequest(custom_id, 3, kind, messages, prompt, sampling, {}, [5, 6, 7])


def finished(n=1, with_logprobs=False, custom_id="req-1"):
    lps = [TokenLogprob(0, -0.1, [(0, -0.1), (1, -2.0), (3, -3.0)]),
           TokenLogprob(2, float("-inf"), [(1, -0.5)])] if with_logprobs else None
    completions = [Completion(i, [0, 2], FinishReason.LENGTH if i else FinishReason.STOP,
                              text=f"Hel wörld {i}", logprobs=lps) for i in reversed(range(n))]
    return FinishedRequest(custom_id, 3, completions)


def make(kind="chat", **kw):
    logprobs = kw.pop("logprobs", False)
    top = kw.pop("top", 0)
    n = kw.pop("n", 1)
    return success_line(pending(kind, logprobs, top, n), finished(n, logprobs), batch_id="batch_x",
                        model="tiny", created=1700000000, decode_token=decode,
                        split_text=split_text, **kw)


def test_chat_success_schema():
    line = make()
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and line["custom_id"] == "req-1"
    assert line["error"] is None and is_success(line)
    response = line["response"]
    assert response["status_code"] == 200 and len(response["request_id"]) == 32
    body = response["body"]
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["created"] == 1700000000 and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                        "content": "Hel wörld 0",
                                                        "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_logprobs_and_choices_in_index_order():
    body = make(logprobs=True, top=2, n=2)["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel"),
                          "top_logprobs": [{"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel")},
                                           {"token": "lo", "logprob": -2.0, "bytes": list(b"lo")}]}
    assert content[1]["bytes"] == list(" wörld".encode()) and content[1]["logprob"] == -9999.0
    orjson.dumps(body)  # -inf was floored, so this is valid JSON


def test_text_completion_schema_with_logprobs():
    body = make("completion", logprobs=True, top=1)["response"]["body"]
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == "Hel wörld 0" and choice["finish_reason"] == "stop"
    assert choice["logprobs"] == {"tokens": ["Hel", " wörld"], "token_logprobs": [-0.1, -9999.0],
                                  "top_logprobs": [{"Hel": -0.1}, {"lo": -0.5, " wörld": -9999.0}],
                                  "text_offset": [0, 3]}


def test_logprobs_absent_unless_requested():
    line = success_line(pending(), finished(with_logprobs=True), batch_id="b", model="m",
                        created=1, decode_token=decode, split_text=split_text)
    assert line["response"]["body"]["choices"][0]["logprobs"] is None


def test_texts_override_and_parsed_reasoning_and_tool_calls():
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
    parsed = [ParsedChoice(None, reasoning="thinking...", tool_calls=[call], reasoning_tokens=4)]
    body = make(texts=["raw text"], parsed=parsed, reasoning_field="both")["response"]["body"]
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "refusal": None,
                       "reasoning_content": "thinking...",
                       "reasoning": "thinking...",
                       "tool_calls": [{**call, "id": message["tool_calls"][0]["id"]}]}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    plain = make(texts=["raw text"])["response"]["body"]
    assert plain["choices"][0]["message"]["content"] == "raw text"
    assert "completion_tokens_details" not in plain["usage"]


def test_tool_call_ids_differ_between_requests_choices_and_calls_and_hold_on_a_resume():
    """The same call text in two requests, two choices or twice in one answer gets distinct ids
    (OpenAI's are unique); the same request answered again (a resume) gets the same ones."""
    call = {"id": "from_the_parser", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}

    def ids(custom_id):
        parsed = [ParsedChoice(None, tool_calls=[call, call]) for _ in range(2)]
        line = success_line(pending(n=2, custom_id=custom_id), finished(2, custom_id=custom_id),
                            batch_id="batch_x", model="tiny", created=1700000000,
                            decode_token=decode, split_text=split_text, texts=["t", "t"],
                            parsed=parsed)
        return [c["id"] for choice in line["response"]["body"]["choices"]
                for c in choice["message"]["tool_calls"]]

    first = ids("req-1")
    assert len(set(first + ids("req-2"))) == 8
    assert first == ids("req-1") and all(i.startswith("call_") for i in first)


def test_error_line_schema():
    line = error_line("batch_x", IntakeError("line-4", 4, "invalid_json", "line 4: bad"))
    assert line["custom_id"] == "line-4" and line["error"] is None and not is_success(line)
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"] == {"error": {"code": "invalid_json", "message": "line 4: bad",
                                                  "param": None, "line": 4,
                                                  "type": "invalid_request_error"}}
    with_param = error_line("b", IntakeError("c", 2, "invalid_sampling_param", "m", "top_p"))
    assert with_param["response"]["body"]["error"]["param"] == "top_p"


def test_failure_line_schema():
    line = failure_line("batch_x", "req-9", 9, "quarantined", "crashed 3 times")
    assert line["response"] is None and not is_success(line)
    assert line["error"] == {"code": "quarantined", "message": "crashed 3 times", "param": None,
                             "line": 9}


def test_lines_are_deterministic_per_batch_and_custom_id():
    assert dumps(make()) == dumps(make())
    other = success_line(pending(), finished(), batch_id="batch_y", model="tiny",
                         created=1700000000, decode_token=decode, split_text=split_text)
    assert other["id"] != make()["id"]
    assert other["response"]["body"]["id"] != make()["response"]["body"]["id"]
    raw = dumps(make())
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1 and orjson.loads(raw) == make()
    err = error_line("batch_x", IntakeError("req-1", 1, "c", "m"))
    assert err["id"] == make()["id"]  # same identity whatever the outcome


def test_text_offsets_are_character_offsets_in_the_decoded_text():
    """On a byte-level tokenizer a CJK character or an emoji spans several tokens, and a
    skipped special token adds no character: each offset is where the token's text starts in
    the whole text (a token inside a character: where that character starts)."""
    from batchgen.detokenizer import Detokenizer
    from batchgen.io.results import char_offsets
    from tiny_models import embedded_tokenizer

    tok = embedded_tokenizer()
    ids = tok.encode("日本的首都。 Party 🎉🎉 naïve", add_special_tokens=False)
    ids = ids[:4] + [tok.eos_token_id] + ids[4:]
    for skip in (True, False):
        detok = Detokenizer(tok, skip)
        expected = [len(detok.split_unfinished(ids[:i])[0]) for i in range(len(ids))]
        assert char_offsets(ids, detok.split_unfinished) == expected
        assert expected == [len(detok.text(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert expected != [sum(len(tok.decode([t])) for t in ids[:i]) for i in range(len(ids))]


def test_a_byte_no_later_token_can_finish_is_text_and_counted():
    """A lone UTF-8 continuation byte (a token a random or odd model may draw) decodes to U+FFFD
    for good: the answer keeps it, mid-text or last, and the offsets after it count it; an
    emoji cut before its last byte is left out of the answer instead."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from batchgen.detokenizer import Detokenizer
    from batchgen.io.results import char_offsets
    from tiny_models import embedded_tokenizer

    tok = embedded_tokenizer()
    lone = tok.convert_tokens_to_ids(bytes_to_unicode()[0x9C])
    detok = Detokenizer(tok)
    hild, there = (tok.encode(w, add_special_tokens=False) for w in (" Hild", " there"))
    ids = hild + [lone] + there
    text = detok.text(ids)
    assert text == " Hild\ufffd there"
    offsets = char_offsets(ids, detok.split_unfinished)
    assert offsets[len(hild)] == len(" Hild") and offsets[len(hild) + 1] == len(" Hild\ufffd")
    assert detok.split_unfinished(hild + [lone]) == (" Hild\ufffd", "")
    assert detok.split_unfinished([lone, lone]) == ("\ufffd\ufffd", "")
    emoji = tok.encode(" 😀", add_special_tokens=False)
    assert len(emoji) > 1
    assert detok.split_unfinished(hild + emoji[:-1]) == (" Hild ", "\ufffd")
    assert detok.split_unfinished(hild + [lone] + emoji[:-1]) == (" Hild\ufffd ", "\ufffd")


def test_tokens_holding_part_of_a_character_are_named_by_their_bytes():
    """OpenAI names such tokens "bytes:\\xNN...": alternatives that would all decode to U+FFFD
    keep apart, the chosen token's logprob stays its own, and chat's `bytes` are exact."""
    from types import SimpleNamespace

    from tiny_models import embedded_tokenizer, tiny_config

    from batchgen.config import OutputConfig
    from batchgen.runner.worker.outputs import OutputFormatter

    tok = embedded_tokenizer()
    loaded = SimpleNamespace(tokenizer=tok, name="m", hf_config=tiny_config("llama"))
    formatter = OutputFormatter(SimpleNamespace(config=SimpleNamespace(output=OutputConfig()),
                                                batch_id="b", created=1,
                                                system_fingerprint=None), loaded)
    ids = tok.encode("😀 日本", add_special_tokens=False)
    labels = [formatter.detokenizer.label(i) for i in ids]
    assert any(label.startswith("bytes:\\x") for label in labels)
    assert all("\ufffd" not in label for label in labels)
    chat = success_line(pending(logprobs=True, top=2), FinishedRequest("req-1", 3, [Completion(
        0, ids, FinishReason.LENGTH, "😀 日本",
        [TokenLogprob(t, -0.5, [(t, -0.5), (ids[0], -1.0)]) for t in ids])]),
        batch_id="b", model="m", created=1, decode_token=formatter.detokenizer.label,
        split_text=formatter.detokenizer.split_unfinished)
    content = chat["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == "😀 日本".encode()
    # Each token's runner-up is another token that alone decodes to U+FFFD.
    partner = {t: ids[1] if t != ids[1] else ids[2] for t in ids}
    text = success_line(pending("completion", logprobs=True, top=2), FinishedRequest(
        "req-1", 3, [Completion(0, ids, FinishReason.LENGTH, "😀 日本",
                                [TokenLogprob(t, -0.5, [(t, -0.5), (partner[t], -1.0)])
                                 for t in ids])]),
        batch_id="b", model="m", created=1, decode_token=formatter.detokenizer.label,
        split_text=formatter.detokenizer.split_unfinished)["response"]["body"]["choices"][0]["logprobs"]
    for token, top in zip(text["tokens"], text["top_logprobs"]):
        assert top[token] == -0.5 and len(top) == 2
