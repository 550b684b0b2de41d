"""Sequence: one choice of one request, as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batchgen.core import PAGE_SIZE, SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"
    """No KV anywhere: never prefilled, or evicted (then re-prefilled with its tokens)."""
    RUNNING = "running"
    """On the device, being prefilled or decoded."""
    SWAPPED = "swapped"
    """KV only in the host pool; must be loaded before it runs again."""
    FINISHED = "finished"


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


@dataclass(eq=False)  # identity semantics: list.remove / `in` must not compare fields
class Sequence:
    seq_id: int
    request_id: str
    choice: int
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    seed: int
    state: SeqState = SeqState.WAITING
    num_computed: int = 0
    """Tokens whose KV exists (on the device while RUNNING, on the host while SWAPPED)."""
    num_on_host: int = 0
    """Tokens whose KV has been copied to the host pages."""
    host_pages: list[int] = field(default_factory=list)
    device_pages: list[int] = field(default_factory=list)
    evictions: int = 0
    logprobs: list | None = None
    """TokenLogprob per generated token, when the request asked for logprobs."""
    matcher: object | None = None
    """Structured-output grammar state (engine.structured.GrammarMatcher), or None."""
    page_keys: list[bytes] = field(default_factory=list)
    """Prefix-cache keys of the full pages of token_ids hashed so far (prefix_cache.py)."""
    cached_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache at the first admission (None until
    admitted)."""
    device_registered: int = 0
    """Leading device pages offered to the prefix cache (reset when the device pages go)."""
    host_registered: int = 0
    """Leading host pages offered to the prefix cache."""
    bypassed: int = 0
    """Sequences admitted past this one while it waited for room (Admission.admit)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_decoded(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def budget_tokens(self) -> int:
        """Most tokens this sequence can ever hold: prompt + max_tokens."""
        return self.prompt_len + self.sampling.max_tokens

    @property
    def pending_tokens(self) -> int:
        """Tokens to compute before the next sample (1 while decoding)."""
        return self.num_tokens - self.num_computed

    def tokens_after(self, decode_steps: int) -> int:
        """KV tokens held after finishing any prefill and `decode_steps` more decode steps."""
        return min(self.num_tokens + decode_steps, self.budget_tokens)


def cached_prompt_tokens(seq: Sequence, copied: bool) -> int:
    """The prompt tokens `seq` found computed when first admitted: whole prompt pages, and
    with `copied` the start of the next page copied from another (a fork or a shared page
    start), never the last prompt token. A sequence continued from a checkpoint holds its
    answer so far too, and may map pages past its prompt (another request's identical prompt
    and answer): those do not make its last prompt token cached."""
    last = seq.prompt_len - 1
    return min(seq.num_computed, last if copied else last // PAGE_SIZE * PAGE_SIZE)
