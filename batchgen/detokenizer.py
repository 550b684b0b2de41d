"""Token ids -> text: the one place batchgen turns tokens back into text.

A `Detokenizer` wraps a Hugging Face tokenizer (its `decode` and `convert_ids_to_tokens`) and
gives each reader the text it needs:
  text()    an answer's text: special tokens skipped unless the job keeps them
            (--detokenization-include-special-tokens); the engine's final text
  markup()  the text with special tokens kept, whatever the job's setting: the reasoning and
            harmony markers the output parsers look for
  newest()  the incremental decode of stop-string checks: the text of a sequence's last tokens
            and where the newest token's characters begin in it
  label()   a token's name in logprobs: its text, or its bytes when it holds part of a character
  split_unfinished()  a text and the U+FFFD of a character that later tokens may still finish
It sits on the floor of the shared types (it imports nothing of batchgen), so the engine
(stops), io (the reasoning parser) and the runner (result lines) all call it.
"""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Sequence
from typing import Any

BYTES_PREFIX = "bytes:"
"""Starts the logprobs name of a token that is not whole characters (then its bytes)."""
REPLACEMENT = "\ufffd"
"""What a decode shows for a character whose bytes are not all there yet."""
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_TAIL_TOKENS = 4
"""Tokens whose bytes `split_unfinished` reads: a character is at most 4 bytes."""


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (transformers' own table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(piece: str) -> bytes | None:
    """The raw bytes of a vocabulary piece that holds part of a character: a SentencePiece
    byte-fallback piece (`<0xE3>`) or a byte-level BPE piece; None when it is neither."""
    match = _BYTE_TOKEN.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if piece and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return None


def bytes_label(raw: bytes) -> str:
    """How OpenAI names a token that is part of a character: "bytes:\\xe3\\x81"."""
    return BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)


class Detokenizer:
    """Decodes token ids of one tokenizer (see the module docstring for who reads what)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        """The Hugging Face tokenizer decoded with (encoding stays with its callers)."""
        self.skip_special = skip_special_tokens
        """Whether text() and newest() leave special tokens out (the job's setting)."""
        self._labels: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._special = (frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
                         if skip_special_tokens else frozenset())

    def text(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` as an answer shows it (special tokens per the setting)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special)

    def markup(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` with every special token kept (channel and think markers)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def newest(self, tail: Sequence[int]) -> tuple[str, int]:
        """The text of `tail` (a sequence's last tokens, the newest one last) and where the
        newest token's characters begin in it: an unfinished character before it (shown as
        U+FFFD) is finished by this token, so it counts as new."""
        before = self.text(tail[:-1])
        return self.text(tail), len(before.rstrip(REPLACEMENT))

    def label(self, token_id: int) -> str:
        """A token's name in logprobs: its text (special tokens by name), or, for a token
        holding part of a character (its text alone decodes to U+FFFD), its bytes as OpenAI
        names them ("bytes:\\xe3\\x81"), so that such alternatives neither collide nor lose
        their bytes. Cached per token id."""
        label = self._labels.get(token_id)
        if label is None:
            label = self.markup([token_id])
            if REPLACEMENT in label:
                raw = token_bytes(self.tokenizer.convert_ids_to_tokens(token_id))
                if raw is not None and raw != label.encode("utf-8"):
                    label = bytes_label(raw)
            self._labels[token_id] = label
        return label

    def split_unfinished(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """The text of `token_ids` cut in two: what an answer that stopped here shows, and the
        U+FFFD its decode shows for a character still unfinished at the end ("" if none): its
        last tokens' bytes end with the start of a UTF-8 character that a later token may
        complete (max_tokens cut an emoji spread over byte tokens). Bytes no later byte can
        make a character of (a lone continuation byte, a lead byte followed by text) are
        finished: U+FFFD is their text for good."""
        text = self.text(token_ids)
        if not text.endswith(REPLACEMENT):
            return text, ""
        tail = [t for t in token_ids[-_TAIL_TOKENS:] if t not in self._special]
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(self._token_bytes(t) for t in tail), final=False)
        pending = len(decoder.getstate()[0])
        # One U+FFFD for those bytes (a lossy decode), or one a byte (a byte-fallback one).
        cut = len(text)
        while cut and len(text) - cut < pending and text[cut - 1] == REPLACEMENT:
            cut -= 1
        return text[:cut], text[cut:]

    def _token_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes: those of a byte piece, else its text's (whole characters)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            raw = token_bytes(piece) if isinstance(piece, str) else None
            if raw is None:
                raw = self.markup([token_id]).encode("utf-8")
            self._bytes[token_id] = raw
        return raw
