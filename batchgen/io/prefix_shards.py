"""Which data-parallel replica takes each request: requests that start alike go to the same one.

Replicas share no KV, so a prompt prefix computed by one replica is computed again by every
other replica that meets it. Records are keyed by the start of their prompt (`prefix_key`: the
first `PREFIX_CHARS` characters of the chat messages or of the completion prompt); records of
one key are laid out together, keys in the order they first appear and records in input order
within a key, and the layout is cut into `world` contiguous runs of equal size (+-1 record). So
each replica gets its share of the job, and a shared prefix is computed by one replica, or by
the two or three whose runs a large group straddles, instead of by all of them.

The assignment depends only on the records and the number of replicas, so every rank and every
resumed run computes the same one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

PREFIX_CHARS = 4096
"""Characters of a prompt's start that key it (~1,000 tokens): records that share less are
spread as if unrelated, which costs each replica at most that prefix once."""


def prefix_key(messages: Sequence[dict] | None, prompt: str | Sequence[int] | None) -> bytes:
    """The key of a chat request (`messages`) or a completion request (`prompt`: text or token
    ids): a digest of its first PREFIX_CHARS characters (or PREFIX_CHARS // 4 token ids)."""
    if messages is not None:
        parts, size = [], 0
        for message in messages:
            text = f"{message.get('role', '')}\x00{message.get('content', '')}\x01"
            parts.append(text)
            size += len(text)
            if size >= PREFIX_CHARS:
                break
        head = "".join(parts)[:PREFIX_CHARS].encode("utf-8", "surrogatepass")
    elif isinstance(prompt, str):
        head = prompt[:PREFIX_CHARS].encode("utf-8", "surrogatepass")
    elif prompt is not None:
        head = b"ids:" + ",".join(str(t) for t in prompt[:PREFIX_CHARS // 4]).encode()
    else:
        head = b""
    return hashlib.blake2b(head, digest_size=12).digest()


def assign_replicas(keys: Iterable[bytes], world: int) -> list[int]:
    """The replica of each record, given each record's key in input order (see the module
    docstring)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    groups: dict[bytes, list[int]] = {}
    count = 0
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
        count = index + 1
    replica = [0] * count
    position = 0
    for members in groups.values():  # keys in order of first appearance
        for index in members:
            replica[index] = position * world // max(1, count)
            position += 1
    return replica
