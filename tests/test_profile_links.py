"""Every profiles/ path the project's text cites exists and is tracked by git, and no
page or file name carries a numbered journal label: a figure without its committed raw
file does not count, and a moved page must not leave a dead link behind."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A path as the pages cite it: profiles/ then name characters, up to a space, a quote, a
# bracket or the end of a sentence. Placeholders (<date>, STEP, *) are not paths.
CITED = re.compile(r"profiles/[A-Za-z0-9_.\-/{},]+")
PLACEHOLDER = re.compile(r"[<>*]|/$")


def _expand(path: str) -> list[str]:
    """`a-{x,y}-{1,2}.json` -> its four names (the pages cite a family of files so)."""
    m = re.search(r"\{([^}]*)\}", path)
    if m is None:
        return [path]
    return [p for alt in m.group(1).split(",")
            for p in _expand(path[:m.start()] + alt + path[m.end():])]


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    return set(out.splitlines())


def _texts() -> list[Path]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "profiles").glob("*.md"))]
    return [p for p in paths if p.is_file()]


def test_every_cited_profiles_path_exists_and_is_tracked():
    tracked = _tracked()
    dirs = {str(Path(t).parent) for t in tracked}
    missing = []
    for text_path in _texts():
        for m in CITED.finditer(text_path.read_text()):
            path = m.group(0).rstrip(".,;:)")
            after = text_path.read_text()[m.end():m.end() + 1]
            if after and after in "<*" or PLACEHOLDER.search(path):
                continue
            for one in _expand(path):
                if one not in tracked and one not in dirs:
                    missing.append(f"{text_path.relative_to(REPO)}: {one}")
    assert not missing, "cited but not tracked:\n" + "\n".join(missing)


def test_relative_links_between_pages_resolve():
    tracked = _tracked()
    bad = []
    for page in sorted((REPO / "profiles").glob("*.md")):
        for target in re.findall(r"\]\(([\w./-]+\.\w+)\)", page.read_text()):
            rel = (page.parent / target).resolve().relative_to(REPO).as_posix()
            if rel not in tracked:
                bad.append(f"{page.name}: {target}")
    assert not bad, bad


def test_no_numbered_journal_labels_in_tracked_text_or_names():
    label = re.compile(r"[Ss]ession\s*\d+")
    hits = [t for t in _tracked() if label.search(t)]
    for t in _tracked():
        if t.startswith(("profiles/h1", "profiles/h2")) and t.endswith(".log"):
            continue  # device logs as they came back (pytest's own "test session starts")
        path = REPO / t
        if path.suffix in {".py", ".md", ".sh", ".txt", ".json", ".toml", ".yml", ".yaml"} \
                and path.is_file() and label.search(path.read_text(errors="replace")):
            hits.append(t)
    assert not hits, hits
