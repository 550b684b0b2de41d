"""The project describes itself as it is, for users: no file outside the repository is cited
(design notes, machine paths, private wheel folders), and no docs page or code comment tells
the story of past work (who did what, in which session). History lives in commit messages.

Python files are checked in their comments and string literals only (docstrings included), so
an identifier never trips a rule; every other text file (docs, shell scripts, sbatch
templates, pyproject) is checked whole."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED_DIRS = ("batchgen", "kernels", "benchmarks", "tests", "scripts", "jobs", "docs",
                "examples", ".ci")
"""Every folder of the project that holds code, docs or scripts."""
SCANNED_FILES = ("README.md", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".sbatch", ".toml", ".txt", ".cfg", ".ini", ".yaml",
                 ".yml", ""}
"""Suffixes of the files read ("" covers extensionless scripts such as .ci/run)."""
SKIPPED_PARTS = {"__pycache__", ".venv", "out", "storage", ".pytest_cache"}
"""Folders never read: caches, virtualenvs, and job outputs the examples write."""
PATH_LISTS = {"startup_modules.txt"}
"""Generated lists of other packages' source files: only their `#` lines are prose."""
THIS_FILE = Path(__file__).resolve()
"""This test names the patterns it forbids, so it does not read itself."""

OUTSIDE_FILES = {
    "design notes": re.compile(r"\bDESIGN\.md\b"),
    "device notes": re.compile(r"\bDEVICE[-_ ]NOTES\b", re.IGNORECASE),
    "style guide": re.compile(r"\bSTYLE\.md\b"),
    "flag reference outside the repository": re.compile(r"\bserver-flags\.md\b"),
    "private wheel folder": re.compile(r"(?<![\w.])\.bench/"),
    "machine path": re.compile(r"(?<![\w.~$}-])/(?:work|root|home)/"),
}
"""Files a user of the project does not have."""

PAST_WORK = {
    "a work session": re.compile(r"(?<![.\w])[Ss]essions?\b(?!['\"])"),
    "a numbered round": re.compile(
        r"\b(?:(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|last|"
        r"previous|this|next|earlier)\s+round(?![\s-]*(?:\(|trip|robin))|round\s+\d+)\b",
        re.IGNORECASE),
    "who did the work": re.compile(
        r"\b(?:the lead(?:'s)?|lead's|a helper's|by a helper|helpers? (?:found|did|fuzzed))\b",
        re.IGNORECASE),
    "a fuzzing diary": re.compile(r"\bfuzz(?:ing)? pass\b|\bfuzzed by\b", re.IGNORECASE),
    "borrowed machine time": re.compile(r"\bdevice[- ]minutes?\b|\blent (?:H200|GPU|machine)",
                                        re.IGNORECASE),
}
"""Wording that narrates past work instead of describing the product."""

ALLOWED = (re.compile(r"""scope\s*=\s*["']session["']"""),)
"""Legitimate uses that a rule would otherwise flag: pytest's session-scoped fixtures."""


def project_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for folder in SCANNED_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            relative = path.relative_to(ROOT).parts
            if (path.is_file() and path.suffix in TEXT_SUFFIXES and path.resolve() != THIS_FILE
                    and not SKIPPED_PARTS.intersection(relative)):
                files.append(path)
    return files


def prose(path: Path, text: str) -> list[tuple[int, str]]:
    """(line number, text) of what a rule reads: comments and strings of Python, else lines."""
    if path.name in PATH_LISTS:
        return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.startswith("#")]
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    pieces = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in kinds:
            lines = token.string.split("\n")
            pieces += [(token.start[0] + i, line) for i, line in enumerate(lines)]
    return pieces


def offences(path: Path, text: str, rules: dict[str, re.Pattern]) -> list[str]:
    found = []
    for number, line in prose(path, text):
        for allowed in ALLOWED:
            line = allowed.sub("", line)
        found += [f"{path}:{number}: {name}: {line.strip()[:120]}"
                  for name, rule in rules.items() if rule.search(line)]
    return found


def scan(rules: dict[str, re.Pattern]) -> list[str]:
    return [hit for path in project_files()
            for hit in offences(path.relative_to(ROOT), path.read_text(encoding="utf-8"), rules)]


def test_the_scan_covers_the_project():
    names = {path.relative_to(ROOT).as_posix() for path in project_files()}
    for expected in ("README.md", "docs/performance.md", "docs/architecture.md",
                     "batchgen/runner/leader/launch.py",
                     "kernels/batchgen_kernels/decode_attention.py",
                     "benchmarks/w2_host_tier.sh", "jobs/single_node.sbatch"):
        assert expected in names, expected


def test_nothing_cites_a_file_outside_the_repository():
    hits = scan(OUTSIDE_FILES)
    assert not hits, "cite docs/ (e.g. docs/architecture.md) instead:\n" + "\n".join(hits)


def test_docs_and_comments_do_not_narrate_past_work():
    hits = scan(PAST_WORK)
    assert not hits, ("describe the product as it is (history belongs in commit messages):\n"
                      + "\n".join(hits))


# The offending samples are assembled from pieces, so this file itself never reads as the
# text it forbids: {S} session, {D} design notes file, {N} device notes, {H} helper, {L} lead.
_PIECES = {"S": "sess" + "ion", "D": "DES" + "IGN.md", "N": "DEVICE-" + "NOTES",
           "H": "hel" + "per", "L": "le" + "ad"}


@pytest.mark.parametrize("text", [t.format(**_PIECES) for t in [
    "# measured in the ninth {S}: 3.3 TB/s\n",
    "x = 1  # see {D} for the rule\n",
    '"""Copies cost ~13 us each ({N})."""\n',
    "# install the wheels from .bench/whl first\n",
    '"""Partitions can break a host (/work/.library/device/KINDS.md)."""\n',
    "# found by a {H}'s fuzz pass against HF\n",
    "# the {L}'s offline wheels\n",
    "# in round 3 the kernel got 2 warps\n",
    "# ~24 device-minutes in five calls\n",
    'log.info("cache under /root/models")\n',
]])
def test_the_rules_flag_what_they_forbid(text):
    rules = {**OUTSIDE_FILES, **PAST_WORK}
    assert offences(Path("x.py"), text, rules), text
    assert offences(Path("x.md"), text, rules), text


@pytest.mark.parametrize("text", [
    '@pytest.fixture(scope="session")\n',
    "session = requests.Session()  # an HTTP client\n",
    "sess = ort.InferenceSession(path)\n",
    "n = round(ratio * 16)  # rounds to nearest\n",
    "# the last round(r * E) experts; a second round trip; the next round-robin share\n",
    "# a round trip through the host tier; test helpers live in tests/engine_utils.py\n",
    "# converted once to ~/.cache/batchgen/converted/, or under $BATCHGEN_CACHE/converted/\n",
    "# see docs/architecture.md, 'Measured transfer costs'\n",
    "# the {H}'s pool is on the CPU; the {L}er merges results\n".format(**_PIECES),
])
def test_the_rules_leave_legitimate_words_alone(text):
    assert not offences(Path("x.py"), text, {**OUTSIDE_FILES, **PAST_WORK}), text
