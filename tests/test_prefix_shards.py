"""Data-parallel replicas take requests that start alike together, in equal shares."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, strategies as st

from batchgen.io.prefix_shards import (LEVEL_BYTES, LEVEL_CHARS, PREFIX_CHARS, _assign_tuples,
                                       assign_replicas, prefix_key)


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_requests_sharing_a_long_system_prompt_share_a_key():
    long = "You are a careful assistant. " * 200  # > PREFIX_CHARS
    assert prefix_key(chat(long, "a"), None) == prefix_key(chat(long, "b"), None)
    assert prefix_key(chat(long, "a"), None) != prefix_key(chat(long[::-1], "a"), None)
    short = "Be brief."
    assert prefix_key(chat(short, "a"), None) != prefix_key(chat(short, "b"), None)


def test_a_key_has_a_level_per_prompt_start():
    """Requests sharing a 600-character system prompt share the key's first level (256
    characters) only; those sharing 2,000 share two."""
    def levels(key: bytes) -> list[bytes]:
        return [key[i:i + LEVEL_BYTES] for i in range(0, len(key), LEVEL_BYTES)]

    mid, longer = "Answer as a tax lawyer would. " * 20, "Cite the statute. " * 112
    a, b = levels(prefix_key(chat(mid, "q1"), None)), levels(prefix_key(chat(mid, "q2"), None))
    assert len(a) == len(LEVEL_CHARS) and a[0] == b[0] and a[1:] != b[1:]
    a, b = (levels(prefix_key(chat(longer, q), None)) for q in ("q1", "q2"))
    assert a[:2] == b[:2] and a[2] != b[2]


def test_requests_sharing_a_system_prompt_shorter_than_the_key_go_together():
    """Two 2,000-character system prompts, 512 distinct questions each, shuffled: over eight
    replicas each replica meets one system prompt, not both."""
    rng = random.Random(1)
    systems = ["You grade essays strictly. " * 74, "You translate into French. " * 74]
    rows = [(s, f"question {i} of {s[:8]}") for s in systems for i in range(512)]
    rng.shuffle(rows)
    replica = assign_replicas([prefix_key(chat(s, q), None) for s, q in rows], 8)
    assert Counter(replica) == {r: 128 for r in range(8)}
    for r in range(8):
        assert len({s for (s, _), owner in zip(rows, replica) if owner == r}) == 1


def test_completion_prompts_key_by_text_or_token_ids():
    text = "x" * PREFIX_CHARS
    assert prefix_key(None, text + "tail one") == prefix_key(None, text + "tail two")
    assert prefix_key(None, "abc") != prefix_key(None, "abd")
    ids = list(range(PREFIX_CHARS))
    assert prefix_key(None, ids + [1]) == prefix_key(None, ids + [2])
    assert prefix_key(None, [1, 2, 3]) != prefix_key(None, [1, 2, 4])
    assert prefix_key(None, "1,2") != prefix_key(None, [1, 2])


def test_four_prefixes_over_eight_replicas_one_each():
    rng = random.Random(0)
    keys = [bytes([k]) for k in range(4) for _ in range(256)]
    rng.shuffle(keys)
    replica = assign_replicas(keys, 8)
    assert Counter(replica) == {r: 128 for r in range(8)}
    for r in range(8):
        assert len({k for k, owner in zip(keys, replica) if owner == r}) == 1


@given(st.lists(st.integers(0, 6), max_size=300), st.integers(1, 9))
def test_shares_are_equal_and_each_key_is_one_run(raw, world):
    keys = [bytes([k]) for k in raw]
    replica = assign_replicas(keys, world)
    assert replica == assign_replicas(keys, world)  # the same on every rank and every run
    sizes = Counter(replica)
    assert sum(sizes.values()) == len(keys)
    if keys:
        counts = [sizes.get(r, 0) for r in range(world)]
        assert max(counts) - min(counts) <= 1
    for key in set(keys):  # a key's records are one run: as few replicas as its size needs
        owners = {owner for k, owner in zip(keys, replica) if k == key}
        size = keys.count(key)
        assert len(owners) <= -(-size * world // len(keys)) + 1


def test_bad_world_is_refused():
    with pytest.raises(ValueError):
        assign_replicas([b"a"], 0)


@given(st.integers(1, 12), st.lists(st.lists(st.sampled_from([0, 1, 255]), min_size=12,
                                             max_size=12), max_size=200), st.integers(1, 9))
def test_packed_keys_are_assigned_as_before(size, raw, world):
    """Resumed jobs and every rank must agree: the numpy assignment is the original one."""
    keys = [bytes(k[:size]) for k in raw]
    assert assign_replicas(keys, world) == _assign_tuples(keys, world)  # the original


def test_assignment_memory_does_not_hold_an_object_per_prefix():
    """A million-line job's ranks each held ~600 MB of dicts and tuples for this (one entry per
    distinct prefix level, one tuple per record): bounded per record now."""
    import hashlib
    import tracemalloc

    n = 50_000
    keys = [hashlib.blake2b(str(i).encode(), digest_size=12).digest() for i in range(n)]
    tracemalloc.start()
    try:
        replica = assign_replicas(keys, 8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert Counter(replica) == {r: n // 8 for r in range(8)}
    assert peak / n < 200, f"{peak / n:.0f} bytes per record"
