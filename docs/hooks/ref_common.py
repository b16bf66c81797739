"""What the reference generators share: where the repository is, where the package's source lives, and how text
goes into a Markdown page."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the package's source folders (pyproject's package-dir): where the code that reads settings and raises errors lives
SOURCE_DIRS = ("fusionserve", "serving", "scoring", "cli", "export", "training")
GENERATED = "<!-- generated from the code by docs/hooks/ at build time: edit the code, not this page -->\n"


def md(text: str) -> str:
    """A docstring's reStructuredText literals (``x``) as Markdown code (`x`)."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def cell(text: object) -> str:
    """Text fit for one Markdown table cell."""
    return md(" ".join(str(text).split())).replace("|", "\\|")


def source_files() -> Iterator[Path]:
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()
