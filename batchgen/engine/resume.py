"""In-flight state out of the engine and back in: what a checkpoint keeps of each unfinished
request, and the sequences that continue it.

A continued sequence holds prompt + generated tokens with `prompt_len` unchanged and no KV
(WAITING, as an evicted one): its first step prefills them all and samples the next token.
Everything else that decides the next tokens follows from the tokens: the sampler's noise
counter is the number of tokens generated (the absolute position, not steps since the
restart), the penalties count the answer so far, min_tokens counts it too, stop strings are
searched in the text's tail, and the grammar matcher is advanced over the generated tokens.
"""

from __future__ import annotations

from batchgen.core import ChoiceProgress, Completion, Request
from batchgen.sched.sequence import Sequence, SeqState


class ResumeError(ValueError):
    """A resumed request whose saved state cannot continue it (wrong number of choices, an
    answer the grammar refuses, more tokens than max_tokens): it starts over instead."""


def progress_of(seqs: list[Sequence], done: list[Completion]) -> list[ChoiceProgress]:
    """The checkpoint entry of one unfinished request: each choice's tokens (and logprobs)
    as the host holds them, or its result when it finished already."""
    finished = {c.index: c for c in done}
    out = []
    for seq in seqs:
        completion = finished.get(seq.choice)
        if completion is not None:
            out.append(ChoiceProgress(list(completion.token_ids), completion.logprobs, completion))
        else:
            logprobs = list(seq.logprobs) if seq.logprobs is not None else None
            out.append(ChoiceProgress(seq.token_ids[seq.prompt_len:], logprobs))
    return out


def restore(seqs: list[Sequence], request: Request) -> list[Completion]:
    """Put `request.resume` into its fresh sequences (prompt only, in choice order): running
    choices get their generated tokens, logprobs and grammar state; finished ones are marked
    FINISHED. Returns the finished choices' completions."""
    resume = request.resume
    if resume is None:
        return []
    if len(resume) != len(seqs):
        raise ResumeError(f"request {request.request_id!r}: the checkpoint holds "
                          f"{len(resume)} choices, the request asks for {len(seqs)}")
    if all(p.done is not None for p in resume):
        raise ResumeError(f"request {request.request_id!r}: every choice finished already")
    completions = []
    for seq, progress in zip(seqs, resume):
        if progress.done is not None:
            seq.state = SeqState.FINISHED
            completions.append(progress.done)
            continue
        _continue(seq, progress)
    return completions


def _continue(seq: Sequence, progress: ChoiceProgress) -> None:
    tokens = progress.token_ids
    if len(tokens) >= seq.sampling.max_tokens:
        raise ResumeError(f"request {seq.request_id!r}: the checkpoint holds {len(tokens)} "
                          f"tokens, max_tokens is {seq.sampling.max_tokens}")
    wanted = seq.sampling.logprobs and tokens
    if (progress.logprobs is None and wanted) or (
            progress.logprobs is not None and len(progress.logprobs) != len(tokens)):
        raise ResumeError(f"request {seq.request_id!r}: logprobs do not match the tokens")
    if seq.matcher is not None:
        for token in tokens:
            if not seq.matcher.accept(token):
                raise ResumeError(f"request {seq.request_id!r}: the grammar refuses the "
                                  "checkpoint's answer")
    seq.token_ids.extend(tokens)
    if wanted:
        seq.logprobs = list(progress.logprobs)
