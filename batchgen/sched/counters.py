"""What the scheduler counts over a run (the engine's stats, the job's progress line)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    decisions: int = 0
    loads: int = 0
    unloads: int = 0
    evictions: int = 0
    reprefill_tokens: int = 0
    chunk_growths: int = 0
    device_extensions: int = 0
    admitted: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of first admissions."""
    cached_prompt_tokens: int = 0
    """Of those, tokens whose KV came from the prefix cache (or a sibling's fork)."""
    forks: int = 0
    """n > 1 choices admitted by copying a sibling's partial last prompt page."""
    shared_tails: int = 0
    """Sequences admitted by copying the start of a device page (cached, or a running
    sequence's) that begins with their next tokens."""
    extra_choices: int = 0
    """n > 1 choices after the first, first admitted (forked or not): their prompts are in
    prompt_tokens too, which is then above the job's prompt tokens (each request's once)."""
