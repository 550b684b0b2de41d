"""Stop strings on a real byte-level tokenizer (SmolLM2's): the text is cut where the earliest
stop starts, among those the newest token completed after min_tokens; multi-token characters
(emoji, CJK) included."""

import random

import pytest

from batchgen.core import SamplingParams
from batchgen.engine.stops import StopChecker
from batchgen.sched.sequence import Sequence
from tiny_models import embedded_tokenizer

TEXTS = ["Once upon a time, the city of Nova Haven was a thriving place.",
         "Party time! 🎉🎉🎉🎉🎉🎉🎉 and then 🎉 again.",
         "日本的首都是东京。东京很大，人口很多。",
         "a.\nb.\n\nc. The end.\n",
         "mixed: naïve café – “quoted” 😀 text ÿ"]


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def run(tok, text: str, stops: list[str], min_tokens: int = 0):
    """Feed text's tokens one by one as the engine does; (final text, matched stop)."""
    checker = StopChecker(tok)
    ids = tok.encode(text, add_special_tokens=False)
    seq = Sequence(0, "r", 0, [1, 2, 3], 3, SamplingParams(stop=stops, min_tokens=min_tokens), 0)
    for token in ids:
        seq.token_ids.append(token)
        if seq.num_decoded >= min_tokens and (found := checker.match(seq)) is not None:
            return checker.final_text(seq, found), found.stop
    return checker.final_text(seq, None), None


def reference(tok, text: str, stops: list[str], min_tokens: int = 0):
    """The same from whole-text decodes: at each token from min_tokens on, the stops that end
    inside that token's characters; the earliest-starting one cuts."""
    ids = tok.encode(text, add_special_tokens=False)
    for n in range(max(1, min_tokens), len(ids) + 1):
        full = tok.decode(ids[:n])
        before = len(tok.decode(ids[:n - 1]).rstrip("\ufffd"))
        found = []
        for order, stop in enumerate(stops):
            start = full.find(stop, max(0, before - len(stop) + 1))
            if start >= 0 and start + len(stop) > before:
                found.append((start, order))
        if found:
            start, order = min(found)
            return full[:start], stops[order]
    return tok.decode(ids), None


@pytest.mark.parametrize("stops, expected", [
    (["y", "it"], ("Once upon a time, the c", "it")),  # one token " city" completes both
    (["it", "y"], ("Once upon a time, the c", "it")),
    (["Nova", "time"], ("Once upon a ", "time")),
])
def test_the_earliest_stop_cuts_whatever_the_list_order(tok, stops, expected):
    assert run(tok, TEXTS[0], stops) == expected


def test_min_tokens_cuts_at_the_stop_that_ended_generation(tok):
    # "i" first appears in "time", among the suppressed tokens; the cut is at a later "i".
    text, stop = run(tok, TEXTS[0], ["i"], min_tokens=6)
    assert stop == "i" and text == reference(tok, TEXTS[0], ["i"], 6)[0]
    assert text.startswith("Once upon a time") and len(text) > len("Once upon a time")


def test_stops_of_many_byte_tokens_match(tok):
    party = "🎉" * 6  # 6 characters, 24 bytes: more tokens than characters
    assert run(tok, TEXTS[1], [party]) == ("Party time! ", party)
    assert run(tok, TEXTS[2], ["东京很大"]) == ("日本的首都是东京。", "东京很大")


def test_random_stops_agree_with_whole_text_decodes(tok):
    rng = random.Random(7)
    for _ in range(150):
        text = rng.choice(TEXTS)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randint(1, 8)])
        if rng.random() < 0.3:
            stops.append("never in any text")
        min_tokens = rng.choice([0, 0, 2, 5])
        assert run(tok, text, stops, min_tokens) == reference(tok, text, stops, min_tokens), \
            (text, stops, min_tokens)


def test_the_token_that_ends_the_answer_leaves_its_text_out(tmp_path, tok):
    """A stop token id or EOS ends the answer without being part of its text (as vLLM), also
    with special tokens kept; it still counts among the answer's tokens."""
    from engine_utils import greedy_requests, load_ours, make_engine
    from tiny_models import save_tiny_chat_model

    from batchgen.config import EngineConfig, MemoryConfig
    from batchgen.engine.engine import Engine

    model = load_ours(save_tiny_chat_model(tmp_path / "m"))
    prompt = tok.encode("Once upon a time")

    def answer(engine, **kw):
        return engine.generate(greedy_requests([prompt], 12, **kw))[0].completions[0]

    free = answer(make_engine(model, tok), ignore_eos=True)
    stop_id = free.token_ids[5]
    k = free.token_ids.index(stop_id)
    assert tok.decode([stop_id]) and len(free.token_ids) == 12
    by_id = answer(make_engine(model, tok), stop_token_ids=(stop_id,))
    assert by_id.token_ids == free.token_ids[:k + 1] and by_id.stop_reason == stop_id
    assert by_id.text == tok.decode(free.token_ids[:k])
    cfg = EngineConfig(memory=MemoryConfig(gpu_kv_cache_size=0.05, host_kv_cache_size=0.1))
    keep_special = Engine(model, cfg.validate(), tok, [stop_id], skip_special_tokens=False)
    by_eos = answer(keep_special)
    assert by_eos.token_ids == free.token_ids[:k + 1]
    assert by_eos.text == tok.decode(free.token_ids[:k], skip_special_tokens=False)


def test_an_unfinished_character_is_no_stop_match(tok):
    """The U+FFFD shown for a character whose bytes are still arriving is not text: a stop
    holding it must not match there (the finished text has no U+FFFD)."""
    text = "Emoji time: 😀😀😀 and 日本."
    assert run(tok, text, ["\ufffd"]) == (text, None)
    assert run(tok, text, ["😀 and"]) == ("Emoji time: 😀😀", "😀 and")


@pytest.mark.parametrize("text", [TEXTS[1], TEXTS[2]])
def test_an_answer_cut_inside_a_character_ends_before_it(tok, text):
    """max_tokens can end an answer between the byte tokens of one character: its text ends
    before that character (as vLLM's), not with the U+FFFD a whole decode shows."""
    ids = tok.encode(text, add_special_tokens=False)
    cuts = [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")]
    assert cuts  # the texts hold characters spread over several tokens
    checker = StopChecker(tok)
    for n in cuts:
        seq = Sequence(0, "r", 0, [1, 2, 3] + ids[:n], 3, SamplingParams(max_tokens=n), 0)
        final = checker.final_text(seq, None)
        assert final == tok.decode(ids[:n]).rstrip("\ufffd") and text.startswith(final)


def test_an_answer_ending_in_a_byte_no_token_can_finish_keeps_its_u_fffd(tok):
    """A lone continuation byte is no start of a character: it decodes to U+FFFD for good, and
    an answer ending with it shows it, as it does mid-answer (only an unfinished character at
    the end is left out)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    lone = tok.convert_tokens_to_ids(bytes_to_unicode()[0x9C])
    checker = StopChecker(tok)
    for answer, shown in (([lone] * 3, "\ufffd" * 3),
                          (tok.encode("ok", add_special_tokens=False) + [lone], "ok\ufffd")):
        seq = Sequence(0, "r", 0, [1, 2, 3] + answer, 3, SamplingParams(max_tokens=9), 0)
        assert checker.final_text(seq, None) == shown
