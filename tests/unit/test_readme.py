"""The README is the front door (issue 39, item 9): at most 150 lines, the two commands first (the test command is
the one CI runs), every page of docs/ linked, the links and anchors of it and of docs/ resolving, and its package
table the package order the code declares (rl_training.LAYERS)."""

from __future__ import annotations

import re

from rl_training import LAYERS
from tests.helpers import REPO

README = REPO / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def readme_package_table(text: str) -> list[str]:
    """The package names of the README's layout block: the `  name/` lines under its `rl_training/` line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"rl_training/\s", line))
    names = []
    for line in lines[start + 1 :]:
        m = re.match(r"  (\w+)/\s", line)
        if not m:
            break
        names.append(m.group(1))
    return names


def test_the_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == ["make demo", "make test"]
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", ci, flags=re.M)  # CI runs the README's test command


def test_the_readmes_links_resolve_and_reach_every_page_of_the_manual():
    assert anchor("On GPUs: Qwen2.5-1.5B-Instruct on GSM8K") == "on-gpus-qwen25-15b-instruct-on-gsm8k"
    broken = []
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        for target, frag in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif frag and path.suffix == ".md" and frag not in anchors(path):
                broken.append(f"{page.name}: {target}#{frag}")
    assert not broken, broken
    linked = {t for t, _ in LINK.findall(README.read_text())}
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages <= linked, f"pages of docs/ the README does not link: {sorted(pages - linked)}"


def test_the_readmes_package_table_is_layers():
    """The README's table of packages names the packages of LAYERS in its order: the one declaration, copied for the
    reader, is checked here."""
    assert readme_package_table("rl_training/  x\n  a/  one\n  b/  two\nevals/\n") == ["a", "b"]
    assert readme_package_table(README.read_text()) == list(LAYERS)
