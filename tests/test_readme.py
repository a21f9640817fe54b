"""The README's two fresh-machine commands are the ones CI and the build configs rely on."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [next(line for line in b.splitlines() if not line.startswith("#")) for b in blocks[:2]]


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [readme_commands()[1]]


def test_main_job_uses_files_in_the_repository():
    main_job = readme_commands()[0]
    paths = re.findall(r"(build_configs/\S+|benchmarks/\S+)", main_job)
    assert paths, f"the README's main command names no build config or benchmark file: {main_job}"
    for path in paths:
        assert (ROOT / path).is_file(), path


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names an existing file (and heading, when it has an anchor)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(ROOT)}: link {target} points to a missing file"
            if anchor and file.suffix == ".md":
                assert anchor in _anchors(file.read_text()), f"{page.relative_to(ROOT)}: link {target}: no such heading"
            checked += 1
    readme_links = re.findall(r"\]\((docs/[^)\s]+)\)", (ROOT / "README.md").read_text())
    assert readme_links, "README.md links to no docs/ page"
    assert checked > len(readme_links)
