"""Victim order for eviction and unloading: a pure priority function, no state."""

from __future__ import annotations

from batchgen.sched.sequence import Sequence


def victim_order(seqs: list[Sequence]) -> list[Sequence]:
    """Fewest decoded tokens first (least work lost); among equals the latest admitted first.

    The sequence with the most decoded tokens is always last, so it is the one that keeps
    running: progress is guaranteed whenever it fits alone.
    """
    return sorted(seqs, key=lambda s: (s.num_decoded, -s.seq_id))
