"""Issue 27, item 12: every file the README names exists, and every section it (or the
code) cites by name is a heading of the README. The README once cited SCENARIOS.md three
times, a file the repository never had.

- file names: Markdown links to paths, and path-like names in the prose (outside code
  blocks, whose commands make their own files): `dir/file.ext` or `FILE.md`;
- sections: `see "Title"`, `"Title" above/below`, and `README: Title` / `README,
  "Title"` in the README and in the code's docstrings and messages; a citation matches
  the heading it begins (`README: Curvature` is "Curvature: Gauss-Newton, ...")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The README is the front page; its sections moved into the site's guides (docs/guides),
# which are read alike: their citations, their headings.
GUIDES = {
    str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "docs/guides").glob("*.md"))
}
README = "\n".join([(ROOT / "README.md").read_text(), *GUIDES.values()])

# Outside fenced blocks: what the prose cites.
PROSE = re.sub(r"^```.*?^```", "", README, flags=re.DOTALL | re.MULTILINE)
HEADINGS = [h.strip() for h in re.findall(r"^#{1,6} (.+)$", README, flags=re.MULTILINE)]

FILE = re.compile(
    r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.(?:md|py|json|toml|ya?ml|npz|sh|ts|onnx|cfg|txt))\b"
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SECTION = re.compile(
    r'see "([^"]+)"|"([^"]+)" (?:above|below)|README(?:\.md)?(?::|,) "?([A-Z][\w\' -]+?)"?[)."\n,]'
)


# Names that read like files but are Python modules.
MODULES = {"torch.onnx"}


def _exists(name: str) -> bool:
    return (ROOT / name).exists() or any(ROOT.glob(f"**/{name}"))


def test_every_file_the_readme_names_exists() -> None:
    linked = [m for m in LINK.findall(PROSE) if "://" not in m and not m.startswith("mailto:")]
    # A guide's links are relative to docs/guides (the README's to the root).
    missing = [
        f for f in linked if not (ROOT / f).exists() and not (ROOT / "docs" / "guides" / f).exists()
    ]
    named = [m for m in FILE.findall(PROSE) if "://" not in m and m not in MODULES]
    # A bare name (no folder) may be found anywhere in the repository.
    missing += [f for f in named if not ((ROOT / f).exists() if "/" in f else _exists(f))]
    assert linked and named, "found no citations: has the README's form changed?"
    assert not missing, f"README.md names files that do not exist: {sorted(set(missing))}"


def _sources() -> dict[str, str]:
    texts = {"README.md": README, "ARCHITECTURE.md": (ROOT / "ARCHITECTURE.md").read_text()}
    for folder in ("engine", "service", "clients", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            texts[str(path.relative_to(ROOT))] = path.read_text()
    return texts


def test_every_section_cited_by_name_is_a_heading() -> None:
    cited: list[tuple[str, str]] = []
    for where, text in _sources().items():
        if where == "tests/test_readme_citations.py":
            continue
        for groups in SECTION.findall(text):
            title = " ".join(next(g for g in groups if g).split())
            cited.append((where, title))
    assert cited, "found no section citations"
    unknown = [
        (where, title) for where, title in cited if not any(h.startswith(title) for h in HEADINGS)
    ]
    assert not unknown, f"sections cited that the README does not have: {unknown}"
