"""The documents stand on their own: no pointers outside the repository, no dead links, the paths
README.md and docs/design.md name exist, and the user documentation reads as documentation, not as
a development diary (no session, run or issue numbers, nothing linked in notes/).

Runs on the checkout (no daemon, no device). The files checked are git's list (tracked plus
untracked-but-not-ignored), so a new document is checked before it is committed.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Written in pieces so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "DESIGN" + ".md", "BENCHMARKS" + ".md")

# Markdown whose relative links must resolve: the README and every document under docs/.
LINKED_DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

# Documents whose backticked `mmad/...` paths must exist: all of them.
PATH_DOCS = LINKED_DOCS

# Development-diary wording in user documents (README.md, docs/*.md), searched in prose and code
# alike: the history belongs in git log, CHANGELOG.md and notes/. Each pattern with what it catches.
DIARY = (
    (re.compile(r"\b[Ss]ession \d"), "a session number"),
    (re.compile(r"\b[Rr]uns? \d+\b"), "a run number"),
    (re.compile(r"\b[Ii]ssue \d+"), "an issue number"),
    (re.compile(r"gpu-notes"), "the GPU notebooks (notes/)"),
    (re.compile(r"H100 host"), "the development host"),
)
NOTES = ROOT / "notes"

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def repository_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout: {exc}")
    return sorted({f for f in out.decode().split("\0") if f and (ROOT / f).is_file()})


def prose(text: str) -> str:
    """Markdown without code blocks and inline code (links inside code are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[*_`]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_no_file_points_outside_the_repository():
    offenders = []
    for name in repository_files():
        data = (ROOT / name).read_bytes()
        for needle in FORBIDDEN:
            if needle.encode() in data:
                line = data[:data.index(needle.encode())].count(b"\n") + 1
                offenders.append(f"{name}:{line}: {needle}")
    assert not offenders, "references to documents outside the repository:\n" + "\n".join(offenders)


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_relative_links_resolve(doc):
    path = ROOT / doc
    broken = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif not str(dest).startswith(str(ROOT)):
            broken.append(f"{target} (outside the repository)")
        elif dest == NOTES or NOTES in dest.parents:
            broken.append(f"{target} (into notes/: the development notebooks are not documentation)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor})")
    assert not broken, f"{doc}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", PATH_DOCS)
def test_named_package_paths_exist(doc):
    text = FENCE.sub("", (ROOT / doc).read_text(encoding="utf-8"))
    missing = []
    for span in INLINE_CODE.findall(text):
        token = span.strip("`").split()[0] if span.strip("`").strip() else ""
        if not token.startswith("mmad/"):
            continue
        token = token.rstrip(".,;:)")
        if not (ROOT / token).exists():
            missing.append(token)
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_no_development_diary(doc):
    found = []
    for number, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1):
        for pattern, what in DIARY:
            m = pattern.search(line)
            if m:
                found.append(f"{doc}:{number}: {what}: ...{line[max(0, m.start() - 40):m.end() + 40]}...")
    assert not found, "development history in a user document (move it to CHANGELOG.md or notes/):\n" + "\n".join(found)


def test_every_document_is_in_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in LINK.findall(prose(index.read_text(encoding="utf-8")))
              if t.partition("#")[0] and not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)}
    missing = [doc for doc in LINKED_DOCS if doc.startswith("docs/") and doc != "docs/README.md"
               and (ROOT / doc).resolve() not in linked]
    assert not missing, f"docs/README.md does not link: {missing}"
