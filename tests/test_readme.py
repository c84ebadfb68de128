"""The README stays a front door (issue 63): at most 150 lines, no paragraph over 120 words,
and every relative link in it pointing to a file or folder of the repository.

Findings belong in ``docs/`` (``docs/benchmarks/README.md`` and the usage pages); the README
keeps what the project is, the two commands, the CLI, Python API and server, and results as
table rows with date and machine. A paragraph here is a run of consecutive non-blank lines
outside code fences that is not a table (``|``), a heading (``#``) or a list; each list item
(``- ``, ``* ``, ``1. ``) with its continuation lines counts as a paragraph of its own. Words
are whitespace-separated tokens. Reads the file only: no model, no network.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 150
MAX_WORDS = 120

LIST_ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of every paragraph and list item outside code fences."""
    found: list[tuple[int, list[str]]] = []
    current: list[str] | None = None
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
            current = None
            continue
        if in_fence or not stripped or stripped.startswith(("|", "#")):
            current = None
            continue
        if LIST_ITEM.match(line) or current is None:
            current = [line]
            found.append((number, current))
        else:
            current.append(line)
    return [(number, " ".join(lines)) for number, lines in found]


def relative_links(text: str) -> list[str]:
    """Targets of the Markdown links outside code fences that are not URLs or anchors."""
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    targets = []
    for target in LINK.findall(outside):
        if SCHEME.match(target) or target.startswith("#"):
            continue
        targets.append(unquote(target.split("#", 1)[0]))
    return targets


def test_readme_is_at_most_150_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_LINES}): move findings to docs/"
    )


def test_no_readme_paragraph_over_120_words():
    long = [
        (number, len(body.split()))
        for number, body in paragraphs(README.read_text())
        if len(body.split()) > MAX_WORDS
    ]
    assert not long, (
        f"paragraphs over {MAX_WORDS} words (line, words): {long}; make results table rows "
        "and move the prose to docs/benchmarks/README.md or a usage page"
    )


def test_readme_relative_links_exist():
    links = relative_links(README.read_text())
    assert links, "no relative links found: the link pattern no longer matches"
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_paragraph_rules():
    text = "\n".join(
        [
            "# Title",
            "one two three",
            "four",
            "",
            "```",
            "not counted at all",
            "```",
            "| a | b |",
            "- item one",
            "  continues",
            "- item two",
            "1. numbered",
            "after",
        ]
    )
    assert paragraphs(text) == [
        (2, "one two three four"),
        (9, "- item one   continues"),
        (11, "- item two"),
        (12, "1. numbered after"),
    ]
    links = "[a](docs/x.md#part) [b](https://x.org) [c](#here)\n```\n[d](nowhere.md)\n```\n"
    assert relative_links(links) == ["docs/x.md"]
