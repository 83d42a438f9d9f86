"""The documentation against the code: the hook table in docs/plugins.md lists exactly the hooks of
hookspecs/hooks.py (names, parameters, firstresult), every relative link in README.md and docs/*.md leads to
a file (and heading) that exists, and the README stays short."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ddp_plugin.hookspecs import PROJECT_NAME

ROOT = Path(__file__).resolve().parents[1]
PLUGINS_DOC = ROOT / "docs" / "plugins.md"
SPEC_FILE = ROOT / "hookspecs" / "hooks.py"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 16_000
CHANGELOG_LIMIT = 30_000
"""The most bytes one release's part of CHANGELOG.md may take."""
SPEC_ATTR = f"{PROJECT_NAME}_spec"  # what pluggy's HookspecMarker("ddp_plugin") sets on a hook specification


# ---------------------------------------------------------------------- the hook table


def spec_module() -> ModuleType:
    """``ddp_plugin.hookspecs.hooks``, from this checkout's ``hookspecs/hooks.py``.

    An editable install made from another checkout of the repository (a shared virtual environment) maps
    ``ddp_plugin.hookspecs`` to that checkout's folder whatever ``PYTHONPATH`` says; the table must be compared
    with the file next to it, so then that file is loaded by path."""
    module = importlib.import_module("ddp_plugin.hookspecs.hooks")
    if Path(module.__file__).resolve() == SPEC_FILE.resolve():
        return module
    spec = importlib.util.spec_from_file_location("_docs_check_hookspecs_hooks", SPEC_FILE)
    assert spec is not None and spec.loader is not None
    local = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = local
    try:
        spec.loader.exec_module(local)
    finally:
        sys.modules.pop(spec.name, None)
    return local


def specified_hooks() -> dict[str, tuple[list[str], bool]]:
    """Every hook specification in hooks.py: name -> (parameter names, firstresult)."""
    module = spec_module()
    hooks = {}
    for name, func in vars(module).items():
        opts = getattr(func, SPEC_ATTR, None)
        if opts is None or not inspect.isfunction(func):
            continue
        hooks[name] = (list(inspect.signature(func).parameters), bool(opts.get("firstresult")))
    return hooks


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def hook_table() -> list[dict[str, str]]:
    """The rows of the table in docs/plugins.md whose header has the columns `hook` and `firstresult`."""
    lines = PLUGINS_DOC.read_text(encoding="utf-8").splitlines()
    tables = []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            continue
        header = [c.lower() for c in _cells(line)]
        if "hook" in header and "firstresult" in header and i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: "):
            rows = []
            for row in lines[i + 2 :]:
                if not row.lstrip().startswith("|"):
                    break
                rows.append(dict(zip(header, _cells(row))))
            tables.append(rows)
    assert len(tables) == 1, f"{PLUGINS_DOC.name} must have one table with the columns `hook` and `firstresult`"
    return tables[0]


def _hook_name(cell: str) -> str:
    match = re.fullmatch(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell)
    assert match, f"the first column of the hook table must be a hook name in backticks, got {cell!r}"
    return match.group(1)


def _parameters(cell: str) -> list[str]:
    if cell.lower() == "none":
        return []
    match = re.fullmatch(r"`([^`]*)`", cell)
    assert match, f"the parameters column must be `a, b, c` or none, got {cell!r}"
    return [p.strip() for p in match.group(1).split(",") if p.strip()]


def _yes_no(cell: str) -> bool:
    assert cell.lower() in ("yes", "no"), f"the firstresult column must be yes or no, got {cell!r}"
    return cell.lower() == "yes"


def test_hook_table_lists_every_hook_of_the_spec():
    spec = specified_hooks()
    assert spec, "no hook specifications found in hookspecs/hooks.py"
    names = [_hook_name(row["hook"]) for row in hook_table()]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"hooks listed twice in the table of {PLUGINS_DOC.name}: {duplicates}"
    missing = sorted(set(spec) - set(names))
    extra = sorted(set(names) - set(spec))
    problems = [f"no row for {name}" for name in missing] + [f"a row for {name}, which is not a hook" for name in extra]
    assert not problems, "the hook table in docs/plugins.md is out of sync with hookspecs/hooks.py: " + "; ".join(problems)


def test_hook_table_matches_each_hooks_options_and_parameters():
    spec = specified_hooks()
    wrong = []
    for row in hook_table():
        name = _hook_name(row["hook"])
        if name not in spec:
            continue  # reported by the test above
        params, firstresult = spec[name]
        if _yes_no(row["firstresult"]) != firstresult:
            wrong.append(f"{name}: firstresult is {'yes' if firstresult else 'no'} in hooks.py")
        if "parameters" in row and _parameters(row["parameters"]) != params:
            wrong.append(f"{name}: parameters are `{', '.join(params)}` in hooks.py, not {row['parameters']}")
    assert not wrong, "the hook table in docs/plugins.md is out of sync with hookspecs/hooks.py:\n" + "\n".join(wrong)


# ---------------------------------------------------------------------- links


def _without_code(text: str) -> str:
    """Markdown without fenced code blocks, and with inline code reduced to a placeholder (links may hold it)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "code", text)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = _without_code(path.read_text(encoding="utf-8"))
    return re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_existing_files_and_headings(doc: Path):
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"broken links in {doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_docs_link_to_nothing_outside_the_repository_by_path():
    for doc in DOCS:
        for target in links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith("#"):
                continue
            dest = (doc.parent / target.partition("#")[0]).resolve()
            assert dest == ROOT or ROOT in dest.parents, f"{doc.relative_to(ROOT)} links outside the repository: {target}"


def test_readme_stays_short():
    """What a reader sees: HTML comments (the generated table's markers) are not counted."""
    text = re.sub(r"<!--.*?-->\n?", "", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    size = len(text.encode())
    assert size < README_LIMIT, f"README.md is {size} bytes; keep it under {README_LIMIT} (move details to docs/)"


def test_changelog_stays_a_changelog():
    """Each release's part under 30 KB (the file grows by a release at a time), and no fix of a feature that no
    release had (such a fix belongs to its feature's entry)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = [part for part in text.split("\n## ")[1:]]
    assert releases[0].startswith("[Unreleased]") and all(r.startswith("[") for r in releases)
    sizes = {r.partition("\n")[0]: len(r.encode()) for r in releases}
    assert all(size < CHANGELOG_LIMIT for size in sizes.values()), sizes
    first = releases[-1]
    assert "### Fixed" not in first and "### Changed" not in first, "the first release only adds"


# ---------------------------------------------------------------------- the flags' documentation (generated)


def test_flag_docs_are_as_generated_from_the_config():
    """README.md's flags table, the docs pages' flag tables and the ``Args:`` of the strategy's docstring are
    generated from ``ddp_plugin.strategy.config.FLAGS``: edited by hand, or a flag changed without regenerating
    them, they fail here with the command that regenerates them."""
    import difflib

    from ddp_plugin.strategy import flag_docs

    stale = [r for r in flag_docs.regions(ROOT) if r.current != r.expected]
    diffs = ["\n".join(list(difflib.unified_diff(r.current.splitlines(), r.expected.splitlines(), f"{r.path} (now)",
                                                 f"{r.path} (generated)", lineterm="", n=0))[:12]) for r in stale]
    assert not stale, (f"the flags' documentation is out of date; run `{flag_docs.COMMAND}` (and edit"
                       " ddp_plugin/strategy/config.py's FLAGS, not the generated text):\n" + "\n".join(diffs))


def test_readme_flags_table_has_a_row_for_every_flag():
    """Read from the README itself, not from the generator: every flag of the strategy is named once."""
    from ddp_plugin.strategy.config import flag_names

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("<!-- flags: all;"):text.index("<!-- /flags -->")]
    named = [name for line in table.splitlines()[3:] if line.startswith("|")
             for name in re.findall(r"`(\w+)`", _cells(line)[0])]
    assert sorted(named) == sorted({*flag_names(), "config"})


def test_flag_docs_check_names_the_command_and_write_repairs(tmp_path, capsys):
    from ddp_plugin.strategy import flag_docs

    for rel in ["README.md", flag_docs.STRATEGY_SOURCE, *(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md"))]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text(encoding="utf-8"), encoding="utf-8")
    readme, source = tmp_path / "README.md", tmp_path / flag_docs.STRATEGY_SOURCE
    readme.write_text(readme.read_text().replace("| collective timeout |", "| the collective timeout |"))
    source.write_text(source.read_text().replace("        timeout: collective timeout.", "        timeout: by hand."))
    assert flag_docs.stale(tmp_path) == ["README.md: all", f"{flag_docs.STRATEGY_SOURCE}: HierarchicalZeroStrategy's"
                                                           " docstring Args"]
    assert flag_docs.main(["--root", str(tmp_path)]) == 1
    assert f"Run `{flag_docs.COMMAND}`" in capsys.readouterr().out
    assert flag_docs.main(["--root", str(tmp_path), "--write"]) == 0
    assert flag_docs.stale(tmp_path) == []
    assert readme.read_text() == (ROOT / "README.md").read_text()
    assert source.read_text() == (ROOT / flag_docs.STRATEGY_SOURCE).read_text()


def test_flag_docs_refuse_a_marker_naming_no_flag(tmp_path):
    from ddp_plugin.strategy import flag_docs

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
    (tmp_path / "docs" / "page.md").write_text(
        f"<!-- flags: sync_every sync_evry; generated by {flag_docs.COMMAND} -->\n{flag_docs.END}\n")
    with pytest.raises(ValueError, match=r"docs/page.md: the flags marker names sync_evry, not flags; allowed: all,"
                                         r" or names of zero_stage, "):
        flag_docs.regions(tmp_path)
