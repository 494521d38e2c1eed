"""The repository's docs stand alone: every relative link in its Markdown files resolves to a file inside it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SKIPPED_DIRS = {".venv", ".git", "node_modules", "bench-results", "build"}


def _markdown_files() -> list[Path]:
    return sorted(p for p in REPO.rglob("*.md")
                  if not SKIPPED_DIRS & set(p.relative_to(REPO).parts) and not p.name.startswith(".")
                  and not any(part.startswith(".venv") for part in p.relative_to(REPO).parts))  # .venv-vllm, ...


def _links(path: Path) -> list[str]:
    """Link targets of ``path`` outside fenced code blocks."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return LINK.findall(text)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Relative links of ``path`` whose file is missing or outside ``root``, or whose anchor is not a heading."""
    bad = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not a file of the repository
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.is_relative_to(root):
            bad.append(f"{target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor})")
    return bad


def test_every_relative_link_in_the_docs_resolves_inside_the_repository() -> None:
    files = _markdown_files()
    assert REPO / "README.md" in files and REPO / "docs" / "DESIGN.md" in files
    bad = {str(p.relative_to(REPO)): b for p in files if (b := broken_links(p))}
    assert bad == {}


def test_readme_points_at_the_design_document() -> None:
    assert "docs/DESIGN.md" in _links(REPO / "README.md")


def test_the_check_catches_a_link_out_of_the_repository(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "DESIGN.md").write_text("# kvstore\n\n## The daemon\n")
    probe = root / "docs" / "probe.md"
    probe.write_text("[up](../../shared/DESIGN.md) [gone](nothing.md) [ok](DESIGN.md#the-daemon) "
                     "[bad anchor](DESIGN.md#no-such-part) [web](https://example.org/x)\n")
    assert broken_links(probe, root) == ["../../shared/DESIGN.md (outside the repository)",
                                         "nothing.md (no such file)", "DESIGN.md#no-such-part (no heading #no-such-part)"]
