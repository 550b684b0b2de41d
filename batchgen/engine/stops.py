"""Stop strings and final text: the only place the engine detokenizes."""

from __future__ import annotations

from batchgen.sched.sequence import Sequence

TAIL_SLACK = 8
"""Extra tokens decoded beyond the longest stop string, for multi-token characters."""


class StopChecker:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens

    def match(self, seq: Sequence) -> str | None:
        """The stop string that the newest tokens completed, if any.

        Only a tail is decoded each step (a stop string of L characters spans at most L
        tokens), so the check stays O(L) per token instead of O(length).
        """
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass one to Engine")
        stops = seq.sampling.stop
        tail = max(len(s) for s in stops) + TAIL_SLACK
        generated = seq.token_ids[seq.prompt_len:]
        text = self.tokenizer.decode(generated[-tail:], skip_special_tokens=self.skip_special)
        last = self.tokenizer.decode(generated[-1:], skip_special_tokens=self.skip_special)
        # Only stops that end within the newest token's text count now; earlier ones would
        # have stopped the sequence already.
        window = text[-(max(len(s) for s in stops) + len(last)):]
        for stop in stops:
            if stop in window:
                return stop
        return None

    def final_text(self, seq: Sequence, stop: str | None) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(seq.token_ids[seq.prompt_len:],
                                     skip_special_tokens=self.skip_special)
        if stop is not None:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return text
