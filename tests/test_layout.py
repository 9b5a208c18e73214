"""The layout keeps its seams: no import cycle among HetSeq's modules, the
update imports nothing of the run, start-up nothing of reporting, and no
library module grows past 400 lines (docs/design.md).

Imports are read from the source, not from a running interpreter, so the
lazy ones count too: an ``import`` inside a function, ``import_module``
with a module's name (a literal, or a string literal naming a module that
the module passes to it). Importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__`` first, so it depends on them too, except for a module's
own packages (Python has finished or is running them already)."""

import ast
from pathlib import Path

import pytest

from conftest import ROOT

LIBRARY = ROOT / "hetseq"
MAX_LINES = 400


def modules(root):
    """{dotted name: path} of every module under ``root`` (a package folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(node, name, is_package, known):
    """Dotted names ``node`` imports (unresolved: may name an attribute)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
        return [node.value]      # a module's name, e.g. handed to import_module
    return []


def _logger_names(tree):
    """String literals that name a logger (getLogger("hetseq.run")), not a module."""
    return {id(arg) for call in ast.walk(tree) if isinstance(call, ast.Call)
            and getattr(call.func, "attr", getattr(call.func, "id", "")) == "getLogger"
            for arg in call.args}


def import_graph(root):
    """{module: set of HetSeq modules importing it runs first}."""
    known = modules(root)
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        loggers, edges = _logger_names(tree), set()
        for node in ast.walk(tree):
            if id(node) in loggers:
                continue
            for target in _targets(node, name, path.name == "__init__.py", known):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    # The packages on the way run first, unless they are the importer's own.
                    package = ".".join(parts[:i])
                    if package in known and package != name and \
                            (i == len(parts) or not name.startswith(package + ".")):
                        edges.add(package)
        if path.name == "__init__.py" and _walks_its_modules(tree):
            edges |= {module for module in known if module.rpartition(".")[0] == name}
        graph[name] = edges
    return graph


def _walks_its_modules(tree):
    """A package that imports every module in it (pkgutil.iter_modules, as
    update/modes/ does for its plugins): it imports each of them."""
    return any(isinstance(node, ast.Attribute) and node.attr == "iter_modules"
               for node in ast.walk(tree))


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_hetseqs_modules():
    assert cycles(import_graph(LIBRARY)) == []


@pytest.mark.parametrize("lower, upper", [("hetseq.update", "hetseq.run"),
                                          ("hetseq.distributed", "hetseq.reporting")])
def test_a_lower_floor_imports_nothing_from_an_upper_one(lower, upper):
    graph = import_graph(LIBRARY)
    wrong = sorted(f"{m} imports {t}" for m, targets in graph.items()
                   if m == lower or m.startswith(lower + ".")
                   for t in targets if t == upper or t.startswith(upper + "."))
    assert wrong == []


def test_every_library_module_is_within_its_limit():
    long = {str(p.relative_to(ROOT)): n for p in LIBRARY.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_graph_sees_lazy_imports_packages_and_cycles(tmp_path):
    """The reader above finds what it must, or the tests above prove nothing."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text(
        "import importlib, logging\nlogging.getLogger('pkg.a')\n"
        "MODULES = ('pkg.a',)\n\ndef g():\n    for m in MODULES:\n"
        "        importlib.import_module(m)\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.c"}       # lazy, and the package on the way
    assert graph["pkg.sub.b"] == {"pkg.sub.c"}               # not its own package
    assert graph["pkg.sub.c"] == {"pkg.a"}                   # import_module of a named module
    assert cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.sub.c"]]
    (pkg / "sub" / "c.py").write_text("import logging\nlogging.getLogger('pkg.a')\n")
    assert cycles(import_graph(pkg)) == []                   # a logger's name is no import
    (pkg / "plugins").mkdir()
    (pkg / "plugins" / "__init__.py").write_text(
        "import importlib, pkgutil\nfor m in pkgutil.iter_modules(__path__):\n"
        "    importlib.import_module(f'{__name__}.{m.name}')\n")
    (pkg / "plugins" / "mine.py").write_text("import pkg.a\n")
    (pkg / "a.py").write_text("import pkg.plugins\n")
    assert "pkg.plugins.mine" in import_graph(pkg)["pkg.plugins"]     # its plugins, by walking
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.plugins", "pkg.plugins.mine"]]


MAX_DOCSTRING_LINES = 10


def test_docstrings_say_what_and_why_in_a_few_lines():
    """A docstring says what and why; essays and figures live in docs/ and
    bench/, where they are kept true (the gradient math sits beside its code)."""
    long = []
    for name, path in modules(LIBRARY).items():
        tree = ast.parse(path.read_text(), str(path))
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc.strip().splitlines()) > MAX_DOCSTRING_LINES:
                    long.append(f"{name}.{getattr(node, 'name', '')}")
    assert long == [], f"docstrings over {MAX_DOCSTRING_LINES} lines: {long}"
