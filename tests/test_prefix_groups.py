"""Prefix groups of decode batches: the scheduler's shares become row groups
(sched/decode_groups.py), and a job's decode bursts (continuations included) carry them to
the model's forward with pages that really are each row's leading pages."""

from __future__ import annotations

import torch

from batchgen.core import PAGE_SIZE, Request, SamplingParams
from batchgen.sched.decode_groups import MIN_SAVED_SHARE, group_rows
from batchgen.sched.sequence import Sequence
from batchgen.sched.step import PrefixShare, SeqChunk
from test_decode_burst import chat, engine, outcome  # noqa: F401  (the fixture)


def decode_rows(contexts):
    seqs = [Sequence(i, f"r{i}", 0, [1] * c, c, SamplingParams(), 0)
            for i, c in enumerate(contexts)]
    return [SeqChunk(s, s.num_tokens - 1, s.num_tokens, True) for s in seqs]


def test_rows_join_their_share_and_others_stay_alone():
    chunks = decode_rows([700] * 5)
    shares = [PrefixShare([0, 2, 4], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
              PrefixShare([1, 99], [3])]  # seq 99 is not in this batch: a group of one
    row_group, pages = group_rows(chunks, shares)
    assert row_group == [0, -1, 0, -1, 0]
    assert pages == [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


def test_groups_that_save_most_are_kept_and_prefixes_are_cut():
    chunks = decode_rows([1000] * 9)
    shares = [PrefixShare([0, 1], list(range(10))),        # saves 10 page reads
              PrefixShare([2, 3, 4, 5], list(range(20, 32))),  # saves 36
              PrefixShare([6, 7, 8], list(range(40, 55)))]     # saves 28
    row_group, pages = group_rows(chunks, shares, max_groups=2, max_pages=12)
    assert row_group == [-1, -1, 0, 0, 0, 0, 1, 1, 1]
    assert pages == [list(range(20, 32)), list(range(40, 52))]


def test_no_groups_when_they_save_little():
    chunks = decode_rows([64 * 40] * 8)
    read = 8 * 40  # pages of 2,560 keys per row
    pages = int(MIN_SAVED_SHARE * read) - 1  # one group of two rows saves `pages` reads
    assert group_rows(chunks, [PrefixShare([0, 1], list(range(pages)))]) is None
    assert group_rows(chunks, [PrefixShare([0, 1], list(range(pages + 2)))]) is not None
    assert group_rows(chunks, []) is None


def checked_groups(eng, seen: list) -> None:
    """Wrap `eng`'s forward: every batch's prefix groups must name pages that lead each
    grouped row's page table (a mixed batch's rows being its one-row part's); `seen` gets
    (decode-only, rows grouped) per batch with groups."""
    forward = eng.runner._forward

    def checking(batch):
        groups = batch.prefix_groups
        if groups is not None:
            if batch.decode_only:
                table, ctx = batch.page_table, batch.context_lens
            else:
                _, table, ctx = batch.one_row_part
            row_group = groups.row_group.tolist()
            assert len(row_group) == table.shape[0]
            for row, group in enumerate(row_group):
                if group >= 0:
                    count = int(groups.prefix_num_pages[group])
                    assert count and (table[row, :count]
                                      == groups.prefix_pages[group, :count]).all()
                    assert int(ctx[row]) > count * PAGE_SIZE
            seen.append((batch.decode_only, sum(g >= 0 for g in row_group)))
        return forward(batch)

    eng.runner._forward = checking


def shared_prompt_requests(max_tokens, own=(2,)):
    """Requests whose prompts are one 5-page prompt + `own[i]` tokens of their own (the last
    value repeats)."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (5 * PAGE_SIZE,), generator=gen)
    tails = [own[min(i, len(own) - 1)] for i in range(len(max_tokens))]
    return [Request(f"r{i}", shared.tolist() + torch.randint(3, 500, (n,), generator=gen).tolist(),
                    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m))
            for i, (m, n) in enumerate(zip(max_tokens, tails))]


def test_bursts_carry_groups_of_rows_sharing_a_prompt(chat):  # noqa: F811
    """Requests sharing a long prompt: the forwards of their decode bursts (and of the
    continuations queued while a burst runs) get prefix groups whose pages lead each grouped
    row's page table, and the answers are those of a run without groups."""
    model, tokenizer = chat
    reference = outcome(engine(model, tokenizer, 4).generate(shared_prompt_requests([40] * 6)))
    eng = engine(model, tokenizer, 4)
    eng.runner.shared_prefix = True  # the CPU attention ignores the groups; the plan is checked
    seen = []
    checked_groups(eng, seen)
    assert outcome(eng.generate(shared_prompt_requests([40] * 6))) == reference
    assert seen and max(rows for _, rows in seen) >= 5  # rows that mapped the cached prompt
    assert len(seen) > 3  # continuations carried them too


def test_a_mixed_steps_decode_rows_carry_their_groups(chat):  # noqa: F811
    """A prompt whose own long tail is prefilled in chunks while the others, which share its
    first pages, decode: the decode rows of those mixed steps keep their groups, and the
    answers are those of a run without groups."""
    model, tokenizer = chat
    lengths, own = [30] * 4, (2, 2, 2, 300)

    def run(shared_prefix: bool, seen: list):
        eng = engine(model, tokenizer, 4, max_prefill_tokens=64)
        eng.runner.shared_prefix = shared_prefix
        checked_groups(eng, seen)
        return outcome(eng.generate(shared_prompt_requests(lengths, own)))

    plain = []
    reference = run(False, plain)
    seen = []
    assert run(True, seen) == reference
    assert not plain
    assert sum(1 for decode_only, rows in seen if not decode_only and rows == 3) >= 3, seen


def test_group_tensors_have_one_shape_whatever_the_group_count():
    """The step's plan kernel compiles per shape of the group tensors: they always hold
    MAX_GROUPS groups, the unused ones empty, as the CUDA graphs' buffers do."""
    from batchgen.engine.prefix_groups import prefix_groups
    from batchgen.sched.decode_groups import MAX_GROUPS

    chunks = decode_rows([700] * 6)
    for shares in ([PrefixShare([0, 1, 2], list(range(7, 16)))],
                   [PrefixShare([0, 1], [7, 8, 9, 10, 11]), PrefixShare([2, 3], [3, 4, 5, 6]),
                    PrefixShare([4, 5], [20, 21, 22])]):
        groups = prefix_groups(chunks, shares, torch.device("cpu"))
        assert groups.prefix_pages.shape[0] == groups.prefix_num_pages.shape[0] == MAX_GROUPS
        counts = [len(s.pages) for s in shares]
        assert groups.prefix_num_pages.tolist() == counts + [0] * (MAX_GROUPS - len(counts))
        for g, share in enumerate(shares):
            assert groups.prefix_pages[g, :len(share.pages)].tolist() == share.pages
