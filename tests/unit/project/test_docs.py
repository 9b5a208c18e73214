"""The README and docs/ stay true: links resolve, every flag is documented,
every command in them parses, and CI runs the README's test command."""

import ast
import re
import shlex

import pytest

from machinery.settings import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "examples" / "mnist" / "README.md", ROOT / "preprocessing" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _heading_anchor(text):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue          # http(s), mailto
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: link to {target} does not resolve"
        if anchor and resolved.suffix == ".md":
            headings = re.findall(r"(?m)^#+ (.*)$", resolved.read_text())
            assert anchor in {_heading_anchor(h) for h in headings}, \
                f"{page.name}: no heading for #{anchor} in {resolved.name}"


def test_flags_page_is_generated_from_the_parser():
    from hetseq.app.flagdoc import markdown
    assert (ROOT / "docs" / "flags.md").read_text() == markdown(), \
        "docs/flags.md is stale: python -m hetseq.app.flagdoc > docs/flags.md"


def _help_flags(*task):
    from hetseq.app import cli
    from hetseq.tasks import TASKS, import_builtin_tasks, import_user_dir
    import_builtin_tasks()
    if task:
        import_user_dir(str(ROOT / "examples" / "mnist"))
    from hetseq.update import modes
    parser = cli.build_parser(TASKS.get(task[0]) if task else None)
    # Not a mode of a --user-dir that another test of this process imported.
    return {o for group in parser._action_groups if not group.title.startswith(modes.USER_GROUP)
            for action in group._group_actions for o in action.option_strings} - {"-h", "--help"}


@pytest.mark.parametrize("task", [(), ("bert",), ("glue",), ("mnist",)], ids=str)
def test_every_flag_of_help_is_documented_in_docs(task):
    docs = "\n".join(page.read_text() for page in sorted((ROOT / "docs").glob("*.md")))
    missing = sorted(flag for flag in _help_flags(*task) if f"`{flag}`" not in docs)
    assert not missing, f"not in docs/: {missing}"


def _commands(page):
    """The `python train.py ...` commands of a page's code blocks, one string each."""
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            for part in line.split("&&"):
                if "train.py" not in part and "hetseq-train" not in part:
                    continue
                words = shlex.split(part, comments=True)
                for start in ("train.py", "hetseq-train"):
                    if start in words and "..." not in words:
                        commands.append(words[words.index(start) + 1:])
    return commands


ALL_COMMANDS = [(page, c) for page in PAGES for c in _commands(page)]


def test_pages_have_commands():
    assert len(ALL_COMMANDS) >= 10 and any(p.name == "README.md" for p, _ in ALL_COMMANDS)


@pytest.mark.parametrize("page,argv", ALL_COMMANDS,
                         ids=[f"{p.name}:{' '.join(a)[:60]}" for p, a in ALL_COMMANDS])
def test_every_documented_command_parses(page, argv, monkeypatch, tmp_path):
    """No misspelt or removed flag in a documented command (run from the
    repository root; the task of docs/tasks.md from its own code block)."""
    from hetseq.app import cli
    monkeypatch.chdir(ROOT)
    if "mytasks" in argv:
        code = re.search(r"```python\n# mytasks/__init__.py\n(.*?)```", page.read_text(), re.S)
        (tmp_path / "mytasks").mkdir()
        (tmp_path / "mytasks" / "__init__.py").write_text(code.group(1))
        monkeypatch.chdir(tmp_path)
    cli.parse(argv)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"\*\*Pass the tests\*\*.*?```bash\n(.*?)\n```", readme, re.S).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert command.strip() in ci.splitlines(), (command, ci)


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 130


def _design_map():
    """The modules docs/design.md's layout lists, as paths (indentation: 2 per level)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed, folders = set(), []
    for line in block.strip("\n").splitlines():
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip())) // 2
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        elif name.endswith(".py"):
            listed.add("/".join([*folders, name]))
    return listed


def _has_code(path):
    """A package's __init__ with more than its docstring (then the map lists it)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
               for node in body)


def test_the_design_map_lists_every_module_and_only_those():
    listed = {path for path in _design_map() if path.startswith("hetseq/")}
    present = {str(p.relative_to(ROOT)) for p in (ROOT / "hetseq").rglob("*.py")
               if p.name != "__init__.py" or _has_code(p)}
    listed -= {path for path in listed if path.endswith("__init__.py") and not _has_code(ROOT / path)}
    assert sorted(listed - present) == [], "docs/design.md lists modules that do not exist"
    assert sorted(present - listed) == [], "modules missing from docs/design.md's layout"
