"""The documentation: the README stays a short front door, every relative link and image of
the README and of docs/*.md resolves (file and heading anchor), and every page under docs/ is
reachable from the README."""

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300
# Pages that need no link from the README's list (they are linked from where they are cited).
NOT_LISTED = {"design.md"}

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target), with an optional "title"; text may hold one level of
# brackets (an image inside a link).
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _outside_fences(text):
    """The lines of a markdown text that are not inside fenced code blocks (others blanked)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            out.append("")
        elif fence is not None:
            if m and m.group(1).startswith(fence) and not line.strip().lstrip(fence[0]):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def slug(heading):
    """GitHub's anchor of a heading's text: markup dropped, lowercase, punctuation other than
    hyphens and underscores removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor the headings of a markdown file produce, with GitHub's -1, -2 suffixes for
    repeated headings."""
    seen, out = {}, set()
    for line in _outside_fences(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path):
    """(line number, target) of every link, image and reference definition of a markdown file,
    outside fenced code blocks and inline code spans."""
    lines = _outside_fences(path.read_text(encoding="utf-8"))
    found = []
    # Code spans do not cross blank lines: strip them paragraph by paragraph, keeping line
    # numbers.
    start = 0
    while start < len(lines):
        end = start
        while end < len(lines) and lines[end].strip():
            end += 1
        block = "\n".join(lines[start:end])
        block = _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), block)
        for offset, line in enumerate(block.split("\n")):
            for m in _INLINE_LINK.finditer(line):
                found.append((start + offset + 1, m.group(1)))
            m = _REFERENCE_DEF.match(line)
            if m:
                found.append((start + offset + 1, m.group(1)))
        start = end + 1
    return found


def doc_files(root):
    root = Path(root)
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def check_links(root):
    """Every relative link of README.md and docs/*.md under root that does not resolve, as
    'file:line: target: why' strings (empty when all resolve)."""
    root = Path(root).resolve()
    problems = []
    for path in doc_files(root):
        if not path.exists():
            problems.append(f"{path.relative_to(root)}: missing")
            continue
        for lineno, target in links(path):
            where = f"{path.relative_to(root)}:{lineno}: {target}"
            if not target:
                problems.append(f"{where}: empty link")
                continue
            if _SCHEME.match(target) or target.startswith("//"):
                continue  # http(s), mailto and other absolute addresses
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
            if root not in dest.parents and dest != root:
                problems.append(f"{where}: outside the repository")
                continue
            if not dest.exists():
                problems.append(f"{where}: no such file")
                continue
            if anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in "
                                f"{dest.relative_to(root)}")
    return problems


def readme_targets(root):
    """The files the README links to, resolved."""
    root = Path(root).resolve()
    readme = root / "README.md"
    out = set()
    for _, target in links(readme):
        file_part = target.partition("#")[0]
        if file_part and not _SCHEME.match(target):
            out.add((readme.parent / unquote(file_part)).resolve())
    return out


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"


def test_every_relative_link_resolves():
    problems = check_links(ROOT)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    linked = readme_targets(ROOT)
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in NOT_LISTED]
    assert pages, "no pages under docs/"
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def test_slug_follows_github():
    assert slug("Simulator (projections)") == "simulator-projections"
    assert slug("On a GPU (`device.py`)") == "on-a-gpu-devicepy"
    assert slug("Invariants and the tests that hold them") == "invariants-and-the-tests-that-hold-them"
    assert slug("FT-HSDP: the [replica](x.md) layer") == "ft-hsdp-the-replica-layer"
    assert slug("ft.embedding_sync") == "ftembedding_sync"


def test_check_links_reports_broken_links(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "plot.png").write_bytes(b"")
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\nBack to the [README](../README.md).\n\n## Bench\n\ntext\n\n## Bench\n\n"
        "![plot](results/plot.png) ![gone](results/gone.png)\n"
        "[up](../README.md#top) [self](#bench-1) [self2](#bench-2)\n",
        encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[page](docs/page.md) [bench](docs/page.md#bench) [second](docs/page.md#bench-1)\n"
        "[missing page](docs/nothing.md) [bad anchor](docs/page.md#no-such-heading)\n"
        "[web](https://example.org/x.md) [mail](mailto:a@b.c) [folder](docs/results/)\n"
        "`[in code](docs/also-nothing.md)`\n\n"
        "```\n[in a fence](docs/fenced-nothing.md)\n```\n\n"
        "[escape](../outside.md)\n",
        encoding="utf-8")
    problems = check_links(tmp_path)
    assert sorted(problems) == sorted([
        "README.md:4: docs/nothing.md: no such file",
        "README.md:4: docs/page.md#no-such-heading: no heading with anchor #no-such-heading "
        "in docs/page.md",
        "README.md:12: ../outside.md: outside the repository",
        "docs/page.md:11: results/gone.png: no such file",
        "docs/page.md:12: #bench-2: no heading with anchor #bench-2 in docs/page.md",
    ]), problems
    # Repaired, the same tree passes.
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text(encoding="utf-8")
                      .replace("docs/nothing.md", "docs/page.md")
                      .replace("#no-such-heading", "#bench")
                      .replace("../outside.md", "README.md"), encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(page.read_text(encoding="utf-8")
                    .replace("gone.png", "plot.png").replace("#bench-2", "#page"),
                    encoding="utf-8")
    assert check_links(tmp_path) == []
