"""Every relative markdown link in README.md and docs/*.md leads somewhere.

A link ``[text](path#anchor)`` must name a file or folder that exists, relative
to the page that holds it; an anchor into a markdown page (``#anchor`` alone is
the page itself) must be one of that page's headings as GitHub spells them.
Code (fenced blocks and inline spans) and HTML comments are not links.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"(`+).*?\1", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """The page without what cannot hold a link: code blocks, code spans, comments."""
    return INLINE_CODE.sub("", FENCE.sub("", COMMENT.sub("", text)))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[*_`]|<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """``page: target (why)`` for each relative link of ``page`` that leads nowhere."""
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no such heading)")
    return broken


def test_slug_spells_anchors_as_github_does():
    assert slug("P = 2 again at 302c3d5") == "p--2-again-at-302c3d5"
    assert slug("The tuner's search time") == "the-tuners-search-time"
    assert slug("MindSpore: profiled, predicted and measured") == "mindspore-profiled-predicted-and-measured"


def test_code_and_comments_are_not_links():
    text = "`x[j](y)` <!-- [a](missing.md) -->\n```\n[b](missing.md)\n```\n[c](real.md)"
    assert LINK.findall(prose(text)) == ["real.md"]


def test_every_relative_link_in_the_docs_resolves():
    broken = [line for page in PAGES for line in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)
