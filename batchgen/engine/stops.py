"""Stop strings and final text, decoded by the job's Detokenizer (batchgen/detokenizer.py)."""

from __future__ import annotations

from typing import NamedTuple

from batchgen.detokenizer import REPLACEMENT, Detokenizer
from batchgen.sched.sequence import Sequence

TAIL_SLACK = 8
"""Extra tokens decoded beyond the longest stop string, so the tail's first characters (cut
mid-character, or missing a leading space) lie before any match."""


class StopMatch(NamedTuple):
    """A stop string found in the newest text, and where: `from_end` characters of the
    generated text, counted back from its end, start at the match (where the text is cut)."""

    stop: str
    from_end: int


class StopChecker:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        """`tokenizer`: a Hugging Face tokenizer (wrapped in a Detokenizer with
        `skip_special_tokens`), a Detokenizer (used as it is), or None (no text)."""
        if tokenizer is None or isinstance(tokenizer, Detokenizer):
            self.detokenizer = tokenizer
        else:
            self.detokenizer = Detokenizer(tokenizer, skip_special_tokens)

    def match(self, seq: Sequence, token: int | None = None) -> StopMatch | None:
        """The stop string that the newest token (`token`, drawn but not yet appended, else the
        sequence's last) completed, if any; of several, the one that starts first in the text
        (as OpenAI and vLLM cut).

        Only a tail is decoded each step (the longest stop string's UTF-8 bytes in tokens,
        plus TAIL_SLACK), so the check costs the same per token however long the answer: a
        stop string of B UTF-8 bytes spans at most B tokens (an emoji is one character but up
        to 4 byte tokens).
        """
        if self.detokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass one to Engine")
        stops = seq.sampling.stop
        tail = max(len(s.encode("utf-8")) for s in stops) + TAIL_SLACK
        if token is None:
            generated = seq.token_ids[seq.prompt_len:][-tail:]
        else:
            generated = seq.token_ids[max(seq.prompt_len, seq.num_tokens - tail + 1):] + [token]
        # new_from: where the newest token's characters begin. Only stops ending after it
        # count now: earlier ones stopped the sequence already or fell among the first
        # min_tokens tokens, where they are suppressed.
        text, new_from = self.detokenizer.newest(generated)
        # A character still unfinished at the end is no text yet (a stop holding U+FFFD must
        # not match it); the token that finishes it is checked then.
        whole = text.rstrip(REPLACEMENT)
        found = []
        for order, stop in enumerate(stops):
            start = whole.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0:
                found.append((start, order))
        if not found:
            return None
        start, order = min(found)
        return StopMatch(stops[order], len(text) - start)

    def final_text(self, seq: Sequence, stop: StopMatch | None,
                   ended_by_token: bool = False) -> str | None:
        """The answer's text, cut before the stop string `stop`; `ended_by_token`: the last
        token (EOS or a stop token id) ended the answer, and its text is no part of it (as
        vLLM: otherwise `<|im_end|>` with special tokens kept, or a stop id's "." stays).
        A character whose bytes were not all generated (max_tokens cut an emoji or a CJK
        character spread over byte tokens) is no text, as in the stop checks: the text ends
        before it rather than with U+FFFD (as vLLM's); logprobs keep its bytes."""
        if self.detokenizer is None:
            return None
        answer = seq.token_ids[seq.prompt_len:len(seq.token_ids) - int(ended_by_token)]
        if stop is None:
            return self.detokenizer.split_unfinished(answer)[0]
        text = self.detokenizer.text(answer)
        cut = len(text) - stop.from_end
        if text[cut:cut + len(stop.stop)] != stop.stop:
            cut = text.rfind(stop.stop)  # the tail decoded apart from the whole text
        return text[:cut] if cut >= 0 else text
