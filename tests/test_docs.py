"""The documentation is current and whole: the generated CLI reference lists every command's
options today, the README stays a front door, every relative link and anchor resolves, and every
trap the code cites (docs/traps.md §N) exists with tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hookcli.cli import reference
from tests.support.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (outside code blocks)."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def _sections(page: str) -> dict[str, str]:
    """docs/cli.md's text per command ("" for hookcli itself)."""
    parts = re.split(r"^## hookcli ?(\S*)\n", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_cli_reference_has_every_option_of_every_command_today() -> None:
    """docs/cli.md lists every command, and in each command's section every option it takes
    and no option it no longer takes: regenerate it (python -m hookcli.cli.reference) after
    changing an option. Compared by option names, not byte for byte, so that a new Typer or
    Click release that lays help out differently does not turn a fresh install red."""
    import typer

    from hookcli.cli.app import app

    sections = _sections((ROOT / "docs" / "cli.md").read_text())
    group = typer.main.get_command(app)
    names = reference.commands()
    assert list(sections) == ["", *names], "docs/cli.md: python -m hookcli.cli.reference"
    for name in names:
        command = group.commands[name]  # type: ignore[attr-defined]
        shown_params = [p for p in command.params if not getattr(p, "hidden", False)]
        takes = {o for p in shown_params for o in (*p.opts, *p.secondary_opts) if o[0] == "-"}
        takes |= {"-h", "--help"}
        opt = r"(?:-\w|--[\w-]+)"
        lines = re.findall(rf"^\s+({opt}(?:(?:, ?| / ){opt})*)", sections[name], re.M)
        shown = {o.strip() for line in lines for o in re.split(r",| / ", line)}
        assert takes - shown == set(), f"docs/cli.md lacks {name} {sorted(takes - shown)}"
        assert shown - takes == set(), f"docs/cli.md lists {name} {sorted(shown - takes)}"


def test_every_command_has_a_help_with_an_example() -> None:
    names = reference.commands()
    assert {"inspect", "grads", "check", "diff", "maps", "cam", "attn", "lens"} <= set(names)
    for name in names:
        text = reference.help_text(name)
        assert text.startswith(f"Usage: hookcli {name} "), text
        assert "Example: hookcli " in text, name


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400
    # the two commands a newcomer needs come first; CI (.ci/run) runs the second verbatim
    assert lines[3].endswith("hookcli inspect resnet34 sample_images/cat.jpeg"), lines[3]
    assert lines[4].startswith("python3 -m venv .venv") and lines[4].endswith("pytest"), lines[4]
    for page in (ROOT / "docs").glob("*.md"):
        assert f"](docs/{page.name})" in "\n".join(lines), f"the README links no {page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: no heading #{anchor} in {dest.name}"


def test_every_cited_trap_exists_and_names_tests_that_exist() -> None:
    traps = (ROOT / "docs" / "traps.md").read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", traps, re.M)}
    assert sections == set(range(1, len(sections) + 1)) and len(sections) >= 16
    cited: set[int] = set()
    for folder in ("src", "tests", "benchmarks"):
        for source in (ROOT / folder).rglob("*.py"):
            cited |= {int(n) for n in re.findall(r"docs/traps\.md\s+§(\d+)", source.read_text())}
    assert cited and cited <= sections, cited - sections
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", traps)
    assert len(named) >= 16
    for file, test in named:
        assert re.search(rf"^def {test}\(", (ROOT / file).read_text(), re.M), (file, test)


def test_the_cli_reference_is_the_generated_text_byte_for_byte() -> None:
    """docs/cli.md is exactly what `python -m hookcli.cli.reference` writes today: a changed
    help text, default or wording fails here too, not only an option added or gone."""
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    generated = reference.markdown()
    if page != generated:
        import difflib

        diff = "".join(
            difflib.unified_diff(
                page.splitlines(True), generated.splitlines(True), "docs/cli.md", "generated", n=1
            )
        )
        pytest.fail(f"regenerate: python -m hookcli.cli.reference > docs/cli.md\n{diff[:3000]}")
