"""Which data-parallel replica takes each request: requests that start alike go to the same one.

Replicas share no KV, so a prompt prefix computed by one replica is computed again by every
other replica that meets it. Records are keyed by the start of their prompt (`prefix_key`: a
digest of each of its first `LEVEL_CHARS` characters of the chat messages or the completion
prompt, ~64, ~256 and ~1,000 tokens). The records are laid out in trie order of those keys:
grouped by their first level, within it by the second, then the third (groups in the order
they first appear, records in input order within a group), and the layout is cut into `world`
contiguous runs of equal size (+-1 record). So each replica gets its share of the job, and
requests that share a system prompt of a page or more sit together whatever follows it: a
shared prefix is computed by one replica, or by the two or three whose runs a large group
straddles, instead of by all of them.

The assignment depends only on the records and the number of replicas, so every rank and every
resumed run computes the same one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

LEVEL_CHARS = (256, 1024, 4096)
"""Prompt starts (characters; a quarter as many token ids) that key a record, one digest each:
records that share less than the first are spread as if unrelated, which costs each replica
at most that much prefix once."""
PREFIX_CHARS = LEVEL_CHARS[-1]
LEVEL_BYTES = 4
"""Bytes of each level's digest: a collision only files two groups together."""


def prefix_key(messages: Sequence[dict] | None, prompt: str | Sequence[int] | None) -> bytes:
    """The key of a chat request (`messages`) or a completion request (`prompt`: text or token
    ids): the digests of its first LEVEL_CHARS characters (or a quarter as many token ids),
    LEVEL_BYTES each."""
    if messages is not None:
        parts, size = [], 0
        for message in messages:
            text = f"{message.get('role', '')}\x00{message.get('content', '')}\x01"
            parts.append(text)
            size += len(text)
            if size >= PREFIX_CHARS:
                break
        text = "".join(parts)
        heads = [text[:n].encode("utf-8", "surrogatepass") for n in LEVEL_CHARS]
    elif isinstance(prompt, str):
        heads = [prompt[:n].encode("utf-8", "surrogatepass") for n in LEVEL_CHARS]
    elif prompt is not None:
        heads = [b"ids:" + ",".join(str(t) for t in prompt[:n // 4]).encode()
                 for n in LEVEL_CHARS]
    else:
        heads = [b""] * len(LEVEL_CHARS)
    return b"".join(hashlib.blake2b(head, digest_size=LEVEL_BYTES).digest() for head in heads)


def assign_replicas(keys: Iterable[bytes], world: int) -> list[int]:
    """The replica of each record, given each record's key in input order (see the module
    docstring)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    keys = list(keys)
    size = len(keys[0]) if keys else 0
    if size and all(len(key) == size for key in keys):
        return assign_packed(b"".join(keys), size, world).tolist()
    return _assign_tuples(keys, world)


def assign_packed(packed: bytes | bytearray | memoryview, key_size: int,
                  world: int) -> np.ndarray:
    """assign_replicas for keys of one size laid end to end in `packed`, with numpy: about
    50 bytes per record at its peak, where a dict of every level's prefix and a tuple per
    record took ~600 (a million-line job's ranks each held ~600 MB for it)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    raw = np.frombuffer(packed, dtype=np.uint8)
    count = len(raw) // key_size if key_size else 0
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    words = -(-key_size // LEVEL_BYTES)
    padded = np.zeros((count, words * LEVEL_BYTES), dtype=np.uint8)
    padded[:, :key_size] = raw[:count * key_size].reshape(count, key_size)
    chunks = padded.view("<u4")  # one column per level: its LEVEL_BYTES more of the key
    del padded
    group = np.zeros(count, dtype=np.uint64)
    firsts = []
    for level in range(words):
        # a level's prefix = (the previous level's group, this level's bytes)
        value = (group << np.uint64(32)) | chunks[:, level].astype(np.uint64)
        _, first, inverse = np.unique(value, return_index=True, return_inverse=True)
        del value
        group = inverse.reshape(-1).astype(np.uint64)
        # groups of a level ranked by their first appearance (trie order, as in the docstring)
        firsts.append(first[inverse.reshape(-1)])
        del first, inverse
    order = np.lexsort(firsts[::-1])  # stable: input order within a group
    del firsts, group
    replica = np.empty(count, dtype=np.int64)
    replica[order] = np.arange(count, dtype=np.int64) * world // count
    return replica


def _assign_tuples(keys: list[bytes], world: int) -> list[int]:
    """Keys of several sizes (callers other than a job's parsed input)."""
    first_seen: dict[bytes, int] = {}
    order = []
    for index, key in enumerate(keys):  # trie order: each level ranked by first appearance
        levels = [key[:end] for end in range(LEVEL_BYTES, len(key) + LEVEL_BYTES, LEVEL_BYTES)]
        order.append((*(first_seen.setdefault(level, len(first_seen)) for level in levels),
                      index))
    order.sort()
    replica = [0] * len(keys)
    for position, (*_, index) in enumerate(order):
        replica[index] = position * world // max(1, len(keys))
    return replica
