"""Real macOS command output published by other people, for the host readers' tests.

Each file starts with ``#`` header lines: the command, the machine and macOS version when the source
says them, the source (a public issue, page or repository file), and the provenance (``verbatim``,
``excerpt``: lines the source cut, or ``derived``: a real sample with one value replaced by a value the
named source documents, said which; or ``constructed``: no public recording was found, the
output is built from the documented format named in the header). Everything after the header is the
output.
"""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).parent


def sample(name: str) -> str:
    """The output in ``name`` (its ``#`` header removed)."""
    lines = (DIR / name).read_text(encoding="utf-8").splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].startswith("#"):
        start += 1
    return "".join(lines[start:])


def header(name: str) -> str:
    """The ``#`` header of ``name`` (tests check every file names its source)."""
    return "".join(line for line in (DIR / name).read_text(encoding="utf-8").splitlines(keepends=True)
                   if line.startswith("#"))


def names() -> list[str]:
    return sorted(p.name for p in DIR.iterdir() if p.suffix in (".txt", ".json"))
