"""Deterministic continuation: a request stopped mid-answer and admitted again with its
generated tokens (`Request.resume`) ends exactly as it would have without the stop, whatever
decides its tokens: greedy, seeded sampling, n > 1, penalties, min_tokens, logprobs, stop
strings spanning the resume point and structured-output grammars."""

from dataclasses import replace

import pytest

from batchgen.core import ChoiceProgress, Request, SamplingParams
from batchgen.engine.resume import ResumeError
from engine_utils import load_ours, make_engine
from tiny_models import embedded_tokenizer, save_tiny_chat_model


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_ours(save_tiny_chat_model(tmp_path_factory.mktemp("chat")))


def prompts(tok, count: int) -> list[list[int]]:
    texts = ["Once upon a time", "The list of colours:", "def main():", "1, 2, 3,",
             "Dear friend,", "In the beginning", "Q: why? A:", "<html>"]
    return [tok.encode(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(count)]


def run_whole(model, tok, requests, eos=()):
    engine = make_engine(model, tok, eos)
    results = {r.request_id: r for r in engine.generate(requests)}
    WHOLE_TOKENS[tuple(r.request_id for r in requests), eos] = engine.generated_tokens
    return results


WHOLE_TOKENS: dict = {}
"""Tokens the last uninterrupted run of a request set generated."""


def run_stopped(model, tok, requests, stops_at: list[int], eos=()):
    """Run, stopping after each step count in `stops_at`: export the in-flight state, start a
    new engine and admit the unfinished requests with it. (results, tokens generated)."""
    results, generated, todo = {}, 0, {r.request_id: r for r in requests}
    for limit in [*stops_at, None]:
        engine = make_engine(model, tok, eos)
        for request in todo.values():
            engine.add_request(request)
        steps = 0
        while engine.has_unfinished() and (limit is None or steps < limit):
            for done in engine.step():
                results[done.request_id] = done
            steps += 1
        results.update({f.request_id: f for f in engine.settle()})
        generated += engine.generated_tokens
        state = engine.inflight_state()
        todo = {rid: replace(todo[rid], resume=state[rid]) for rid in state}
    assert not todo
    # Nothing is drawn twice: every stop saved all the tokens the host had.
    assert generated == WHOLE_TOKENS.get((tuple(r.request_id for r in requests), eos), generated)
    return results, generated


def assert_same(whole, stopped, exact_logprobs=True):
    assert whole.keys() == stopped.keys()
    for rid, ref in whole.items():
        got = stopped[rid]
        for a, b in zip(ref.completions, got.completions, strict=True):
            assert (a.index, a.token_ids, a.finish_reason, a.text, a.stop_reason) == (
                b.index, b.token_ids, b.finish_reason, b.text, b.stop_reason), rid
            if a.logprobs is None:
                assert b.logprobs is None
                continue
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
                tolerance = 0 if exact_logprobs else 1e-4
                assert abs(x.logprob - y.logprob) <= tolerance


def requests_of(tok, count, **params):
    return [Request(f"r{i}", p, SamplingParams(**params))
            for i, p in enumerate(prompts(tok, count))]


CASES = {
    "greedy": dict(max_tokens=20, temperature=0.0, ignore_eos=True),
    "seeded-0.8": dict(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
    "seeded-top-p-n3": dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, n=3,
                            ignore_eos=True),
    "penalties": dict(max_tokens=20, temperature=0.8, seed=11, presence_penalty=0.7,
                      frequency_penalty=0.4, repetition_penalty=1.3, ignore_eos=True),
    "logprobs": dict(max_tokens=14, temperature=0.0, logprobs=True, top_logprobs=3,
                     ignore_eos=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_continuation_is_exact(model, tok, case):
    requests = requests_of(tok, 6, **CASES[case])
    whole = run_whole(model, tok, requests)
    stopped, _ = run_stopped(model, tok, requests, [3, 2, 5])
    # Tokens drawn after a resume come from a prefill's logits: their logprobs may differ in
    # the last bits from a decode step's; the restored ones are the saved values.
    assert_same(whole, stopped, exact_logprobs=False)


def test_stops_regenerate_no_token(model, tok):
    """The measure the job's figures use: resumed, the stops regenerate nothing."""
    requests = requests_of(tok, 4, **CASES["greedy"])
    whole_engine = make_engine(model, tok)
    whole_engine.generate(requests)
    _, generated = run_stopped(model, tok, requests, [2, 1])
    assert generated == whole_engine.generated_tokens
    # Admitted without their progress, the requests draw their tokens again.
    engine = make_engine(model, tok)
    for request in requests:
        engine.add_request(request)
    for _ in range(2):
        engine.step()
    lost = sum(len(c.token_ids) for p in engine.inflight_state().values() for c in p)
    assert lost > 0


def test_min_tokens_counts_the_tokens_before_the_stop(model, tok):
    """EOS stays banned for the first min_tokens tokens, counted from the answer's start."""
    whole_engine = make_engine(model, tok)
    free = whole_engine.generate(requests_of(tok, 1, max_tokens=12, temperature=0.0,
                                             ignore_eos=True))[0].completions[0].token_ids
    eos = (free[6],)  # an id the model emits at the 7th position: min_tokens must hold it back
    requests = requests_of(tok, 1, max_tokens=12, temperature=0.0, min_tokens=9)
    whole = run_whole(model, tok, requests, eos)
    stopped, _ = run_stopped(model, tok, requests, [3], eos)
    assert_same(whole, stopped)
    assert len(whole["r0"].completions[0].token_ids) >= 9


def test_stop_string_spanning_the_resume_point(model, tok):
    free = run_whole(model, tok, requests_of(tok, 1, max_tokens=16, temperature=0.0,
                                             ignore_eos=True))["r0"].completions[0]
    text = tok.decode(free.token_ids[4:8])
    stop = text[len(text) // 2 - 1:len(text) // 2 + 2]  # inside tokens 4..8: spans a stop at 6
    assert stop.strip()
    requests = requests_of(tok, 1, max_tokens=16, temperature=0.0, stop=(stop,), ignore_eos=True)
    whole = run_whole(model, tok, requests)
    assert whole["r0"].completions[0].stop_reason == stop
    for at in range(2, len(whole["r0"].completions[0].token_ids)):
        stopped, _ = run_stopped(model, tok, requests, [at])
        assert_same(whole, stopped)


def test_n_choices_finished_before_the_stop_keep_their_results(model, tok):
    """A choice that finished while its siblings ran on is saved whole, not redrawn."""
    params = dict(temperature=0.9, seed=5, n=4, max_tokens=14)
    free = run_whole(model, tok, requests_of(tok, 1, **params, ignore_eos=True))["r0"]
    eos = (free.completions[1].token_ids[3],)
    requests = requests_of(tok, 1, **params)
    whole = run_whole(model, tok, requests, eos)
    lengths = sorted(len(c.token_ids) for c in whole["r0"].completions)
    assert lengths[0] < lengths[-1]
    engine = make_engine(model, tok, eos)
    engine.add_request(requests[0])
    while not any(c.done for c in engine.inflight_state().get("r0", [])):
        assert not engine.step()
    stopped, _ = run_stopped(model, tok, requests, [engine.steps, 1], eos)
    assert_same(whole, stopped)


def test_grammar_continues_from_the_saved_answer(model, tok):
    from batchgen.engine.structured import GrammarCompiler

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    grammar = GrammarCompiler(tok, model.config.vocab_size,
                              stop_token_ids=[tok.eos_token_id]).compile(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    requests = [replace(r, grammar=grammar)
                for r in requests_of(tok, 3, max_tokens=40, temperature=0.7, seed=2)]
    eos = (tok.eos_token_id,)
    whole = run_whole(model, tok, requests, eos)
    stopped, _ = run_stopped(model, tok, requests, [4, 5], eos)
    assert_same(whole, stopped)
    bad = replace(requests[0], resume=[ChoiceProgress(tok.encode("not json"))])
    with pytest.raises(ResumeError, match="grammar refuses"):
        make_engine(model, tok, eos).add_request(bad)


def test_a_resume_that_cannot_continue_is_refused(model, tok):
    request = requests_of(tok, 1, max_tokens=4, temperature=0.0, n=2)[0]
    engine = make_engine(model, tok)
    with pytest.raises(ResumeError, match="asks for 2"):
        engine.add_request(replace(request, resume=[ChoiceProgress([5])]))
    with pytest.raises(ResumeError, match="max_tokens"):
        engine.add_request(replace(request, resume=[ChoiceProgress([5] * 4)] * 2))
    assert engine.num_requests == 0 and not engine.has_unfinished()


def test_the_counter_is_the_absolute_position(model, tok):
    """The first token after a resume draws the noise of its position in the answer: with
    the counter reset to 0 it would repeat the first token's draw."""
    from batchgen.engine.sampler import SamplingRows

    request = requests_of(tok, 1, max_tokens=10, temperature=0.8, seed=9)[0]
    engine = make_engine(model, tok)
    engine.add_request(replace(request, resume=[ChoiceProgress([11, 12, 13])]))
    chunk = engine.scheduler.schedule().chunks[0]
    rows = engine._sampling_rows([chunk], 1)[0]
    assert isinstance(rows, SamplingRows) and rows.steps == [3]


def test_the_worker_starts_over_a_request_its_checkpoint_cannot_continue(model, tok):
    from batchgen.runner.worker.worker import RankInfo, Worker

    request = requests_of(tok, 1, max_tokens=4, temperature=0.0, ignore_eos=True)[0]
    fresh = run_whole(model, tok, [request])["r0"].completions[0].token_ids
    worker = Worker.__new__(Worker)  # only what admission uses
    worker.engine, worker.rank, worker.checkpoints = make_engine(model, tok), RankInfo(), None
    worker.resumable = {"r0": [ChoiceProgress([5] * 4)], "other": [ChoiceProgress([1])]}
    worker._admit(request)
    assert worker.resumable == {"other": [ChoiceProgress([1])]}  # taken once
    results = []
    while worker.engine.has_unfinished():
        results.extend(worker.engine.step())
    assert results[0].completions[0].token_ids == fresh
