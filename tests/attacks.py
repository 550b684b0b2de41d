"""Hostile inputs for the security tests: the small ones live in fixtures/attacks/, the large
ones are generated here (never committed)."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "attacks"
NESTED_GROUPS = 100_000


def fixture(name: str) -> Path:
    return FIXTURES / name


def config_bombs() -> dict[str, dict]:
    """field -> config.json overrides asking for an absurd allocation through that field."""
    return json.loads(fixture("config_bombs.json").read_text())


def nested_regex_row(custom_id: str = "evil", depth: int = NESTED_GROUPS) -> dict:
    """A chat line whose response_format pattern nests `depth` groups: 100,000 overflow the
    grammar compiler's stack (SIGSEGV) when it reaches the compiler."""
    pattern = "(" * depth + "a" + ")" * depth
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                     "response_format": {"type": "json_schema", "json_schema": {
                         "name": "deep", "schema": {"type": "string", "pattern": pattern}}}}}


def write_huge_line(path: Path, size: int, custom_id: str = "huge") -> None:
    """Append one JSONL line of about `size` bytes (a prompt of that many characters), written
    in chunks so the test itself never holds it."""
    head = json.dumps({"custom_id": custom_id, "max_tokens": 4, "prompt": ""})[:-2]
    chunk = "lorem ipsum " * 87_381  # ~1 MiB
    with open(path, "a") as f:
        f.write(head)
        written = len(head)
        while written < size:
            f.write(chunk)
            written += len(chunk)
        f.write('"}\n')
