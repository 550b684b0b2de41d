"""Which decode rows read a shared prefix once (the shared-prefix decode kernel's groups),
from the scheduler's shares. Pure page arithmetic: the engine turns the answer into tensors
(engine/prefix_groups.py) and the simulator costs the page reads it saves.

The scheduler lists the running sequences whose leading device pages are the same pages
(`ScheduleOutput.shares`). A decode batch keeps the groups that save the most page reads (at
most `MAX_GROUPS`, each prefix cut to `MAX_PREFIX_PAGES`; the rest of a longer prefix is read
as the rows' own pages), and only when they save at least `MIN_SAVED_SHARE` of the pages the
plain kernel would read: the shared-prefix kernel runs every row in split mode plus a merge,
which a few shared pages do not pay for. Both caps are the shapes of the CUDA graphs' buffers.
"""

from __future__ import annotations

from batchgen.sched.sequence import pages_for
from batchgen.sched.step import PrefixShare, SeqChunk

MAX_GROUPS = 64
"""Groups per decode batch (n > 1 requests make many small ones: 48 groups of 8 rows in a
batch of 384)."""
MAX_PREFIX_PAGES = 256
"""Pages of one group's prefix read once (16,384 tokens)."""
MIN_SAVED_SHARE = 0.125
"""Share of the batch's page reads the groups must save."""


def group_rows(chunks: list[SeqChunk], shares: list[PrefixShare],
               max_groups: int = MAX_GROUPS,
               max_pages: int = MAX_PREFIX_PAGES) -> tuple[list[int], list[list[int]]] | None:
    """(group of each row, -1 for none; each group's prefix pages) for decode rows `chunks`,
    or None when no group is worth it."""
    row_of = {c.seq.seq_id: row for row, c in enumerate(chunks)}
    candidates = []
    for share in shares:
        rows = [row_of[i] for i in share.seq_ids if i in row_of]
        pages = share.pages[:max_pages]
        if len(rows) >= 2 and pages:
            candidates.append(((len(rows) - 1) * len(pages), rows, pages))
    candidates.sort(key=lambda c: -c[0])
    kept = candidates[:max_groups]
    saved = sum(c[0] for c in kept)
    read = sum(pages_for(c.end) for c in chunks)
    if not kept or saved < MIN_SAVED_SHARE * read:
        return None
    row_group = [-1] * len(chunks)
    for group, (_, rows, _) in enumerate(kept):
        for row in rows:
            row_group[row] = group
    return row_group, [pages for _, _, pages in kept]


def saved_page_reads(chunks: list[SeqChunk], shares: list[PrefixShare]) -> int:
    """Page reads a decode step of `chunks` saves by reading its groups' prefixes once."""
    found = group_rows(chunks, shares)
    if found is None:
        return 0
    row_group, pages = found
    members = [row_group.count(g) for g in range(len(pages))]
    return sum((m - 1) * len(p) for m, p in zip(members, pages))
