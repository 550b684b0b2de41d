"""The step contract between the scheduler and whoever runs its plans (the engine, the
simulator, tests).

One step: `Scheduler.schedule()` returns a `ScheduleOutput` (the plan: page copies, then the
chunks to compute), the runner executes it, and `Scheduler.update_from_output(plan, output)`
with a `StepOutput` is the only way results flow back: the tokens each sampled sequence drew,
and which sequences finished. The scheduler then owns every state change (computed tokens,
appended tokens, finishing and freeing pages).

A plan may cover several decode steps back to back (`steps > 1`, a decode burst): the runner
reports each step's tokens as they arrive (`StepOutput.step`), or several steps' tokens at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

from batchgen.sched.sequence import Sequence


@dataclass
class SeqChunk:
    """Compute tokens [start, end) of `seq`; sample the next token when `sample`."""

    seq: Sequence
    start: int
    end: int
    sample: bool


@dataclass
class PageCopy:
    seq_id: int
    src: list[int]
    dst: list[int]


@dataclass
class PrefixShare:
    """Running sequences that read the same leading device pages (a shared prompt prefix):
    a decode step may read those pages once for the whole group."""

    seq_ids: list[int]
    pages: list[int]
    """The shared device pages, in order (the first `len(pages)` pages of every member)."""


@dataclass
class ScheduleOutput:
    """The plan of one step (or of `steps` decode steps back to back)."""

    chunks: list[SeqChunk] = field(default_factory=list)
    swap_out: list[PageCopy] = field(default_factory=list)
    """Device -> host copies, done first (later copies may reuse the freed pages)."""
    device_copies: list[PageCopy] = field(default_factory=list)
    """Device -> device copies (an n > 1 choice forking from a sibling's partial last prompt
    page), done after `swap_out` and before `swap_in` (which may reuse a source page)."""
    swap_in: list[PageCopy] = field(default_factory=list)
    """Host -> device copies, done before the forward."""
    decided: bool = False
    steps: int = 1
    """Decode steps this plan runs back to back: row i computes position chunks[i].start + k
    at step k. Above 1 only for a decode-only plan whose runner asked for a burst."""
    shares: list[PrefixShare] = field(default_factory=list)
    """Groups of running decode rows sharing leading device pages (see PrefixShare)."""

    @property
    def decode_only(self) -> bool:
        """Every chunk computes one token and samples the next (a plain decode step)."""
        return bool(self.chunks) and all(c.sample and c.end - c.start == 1 for c in self.chunks)


@dataclass
class SeqResult:
    """What one sampled chunk produced."""

    chunk: SeqChunk
    tokens: Seq[int]
    """The tokens drawn, one per step from `StepOutput.step` on."""
    logprobs: list | None = None
    """TokenLogprob per token in `tokens`, when the request asked for them."""
    finished: bool = False
    """The last of `tokens` ended the sequence (EOS, stop, grammar or length)."""


@dataclass
class StepOutput:
    """Results of a plan, or of some of its steps."""

    results: list[SeqResult] = field(default_factory=list)
    """Sampled chunks whose sequences are still running, in plan order."""
    step: int = 0
    """The plan's step the first token of each result was drawn at (a burst reports step by
    step)."""
