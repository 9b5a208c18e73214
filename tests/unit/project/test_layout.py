"""The layout keeps its seams (docs/design.md, "Layout"): the packages of
hetseq/ in one declared order, none importing a package above it; no import
cycle among modules; at most three loose modules; no two modules of one
name; no module over 800 lines, and those over 600 or under 60 with one
user said why.

Imports are read from the source, not from a running interpreter, so the
lazy ones count too: an ``import`` inside a function, ``import_module``
with a module's name (a literal, or a string literal naming a module that
the module passes to it). Importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__`` first, so it depends on them too, except for a module's
own packages (Python has finished or is running them already)."""

import ast
import re


from machinery.settings import ROOT

LIBRARY = ROOT / "hetseq"
MAX_LINES = 800             # a hard cap: past it a module holds more than one concept
LONG_LINES = 600            # past it, a module says why here
SMALL_LINES = 60            # under it, with one importer, a module belongs inside it
# Modules over LONG_LINES, and why they are one module.
LONG = {
    "hetseq.update.controller": "one update, read in one place: train_step's steps, the "
                                "gradient math and the step they end with (Stepper)",
}
# Modules under SMALL_LINES with one importer, and why they stand alone.
SMALL = {
    "hetseq.distributed.quick_exit": "the fork server preloads it by name: it must import nothing",
    "hetseq.keyed.nn": "a public API (hetseq.keyed.nn.Dropout, docs/tasks.md): user tasks import it",
}


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


def layers():
    """{package: layer} from docs/design.md's map: a package's line there
    says 'layer N' (the declared order, bottom first)."""
    block = (ROOT / "docs" / "design.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    found = re.findall(r"^  (\w+)/ +layer (\d+),", block, re.M)
    return {f"hetseq.{name}": int(number) for name, number in found}


def package_of(module):
    """hetseq.<package> of ``module`` (of a loose module: itself, in no layer)."""
    return ".".join(module.split(".")[:2])


PACKAGES = {f"hetseq.{p.parent.name}" for p in LIBRARY.glob("*/__init__.py")}


def upward(graph, order):
    """'a imports b' for each import of a package at or above the importer's layer."""
    wrong = []
    for module, targets in graph.items():
        own = package_of(module)
        for target in targets:
            other = package_of(target)
            if own in order and other in order and other != own and order[other] >= order[own]:
                wrong.append(f"{module} (layer {order[own]}) imports {target} "
                             f"(layer {order[other]})")
    return sorted(wrong)


def is_shim(path):
    """A deprecated name kept for old imports: it only imports the module it
    names, warns, and puts that module in its place (sys.modules)."""
    tree = ast.parse(path.read_text())
    seen = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue            # the docstring
        if isinstance(node, ast.Expr) and "DeprecationWarning" in ast.unparse(node):
            seen.add("warns")
            continue
        if isinstance(node, ast.Assign) and ast.unparse(node) == "sys.modules[__name__] = _module":
            seen.add("replaced")
            continue
        if isinstance(node, ast.If) and ast.unparse(node) == (
                "if __name__ == '__main__':\n    _module.main()\n"
                "else:\n    sys.modules[__name__] = _module"):
            seen.add("replaced")         # a command's old name: run as a program, it runs it
            continue
        return False
    return seen == {"warns", "replaced"}


def test_every_package_has_one_layer():
    order = layers()
    assert sorted(order) == sorted(PACKAGES), "docs/design.md's map must give each package a layer"
    assert len(set(order.values())) == len(order), "two packages share a layer"


def test_no_package_imports_one_above_it():
    assert upward(import_graph(LIBRARY), layers()) == []


def test_only_shims_import_the_deprecated_names():
    shims = {name for name, path in modules(LIBRARY).items() if is_shim(path)}
    graph = import_graph(LIBRARY)
    assert sorted(f"{m} imports {t}" for m, targets in graph.items() if m not in shims
                  for t in targets if t in shims) == []


def test_at_most_three_loose_modules():
    loose = [p.name for p in LIBRARY.glob("*.py")
             if p.name not in ("__init__.py", "__main__.py") and not is_shim(p)]
    assert len(loose) <= 3, f"loose modules in hetseq/: {loose} (give them a package)"


def test_no_two_modules_share_a_name_and_none_repeats_its_package():
    names, repeats = {}, []
    for name, path in modules(LIBRARY).items():
        if path.name in ("__init__.py", "__main__.py") or is_shim(path):
            continue
        base, package = name.rpartition(".")[2], name.split(".")[-2]
        names.setdefault(base, []).append(name)
        if package in (base, base + "s"):
            repeats.append(name)
    assert {b: n for b, n in names.items() if len(n) > 1} == {}
    assert repeats == []


def _lines():
    return {name: len(path.read_text().splitlines()) for name, path in modules(LIBRARY).items()}


def test_every_library_module_is_within_its_limit_and_a_long_one_says_why():
    lines = _lines()
    assert {m: n for m, n in lines.items() if n > MAX_LINES} == {}
    assert sorted(m for m, n in lines.items() if n > LONG_LINES) == sorted(LONG)


def test_a_small_module_with_one_user_is_part_of_that_user():
    """The 400-line cap of old split modules by size; a fragment with one
    importer belongs inside it, unless SMALL says why it stands alone."""
    graph, paths, lines = import_graph(LIBRARY), modules(LIBRARY), _lines()
    users = {}
    for module, targets in graph.items():
        for target in targets if not is_shim(paths[module]) else ():
            users.setdefault(target, set()).add(module)
    small = sorted(m for m, n in lines.items() if n < SMALL_LINES and len(users.get(m, ())) == 1
                   and paths[m].name not in ("__init__.py", "__main__.py")
                   and not is_shim(paths[m]))
    assert small == sorted(SMALL)


def test_an_upward_import_is_seen_lazy_or_not(tmp_path):
    """The layer check finds an import of a higher package inside a function."""
    pkg = tmp_path / "hetseq"
    for folder in ("low", "high"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from hetseq.low import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    import hetseq.high.a\n")
    order = {"hetseq.low": 1, "hetseq.high": 2}
    assert upward(import_graph(pkg), order) == [
        "hetseq.low.b (layer 1) imports hetseq.high (layer 2)",
        "hetseq.low.b (layer 1) imports hetseq.high.a (layer 2)"]
    (pkg / "low" / "b.py").write_text("")
    assert upward(import_graph(pkg), order) == []


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


def test_the_unit_tier_mirrors_the_packages():
    """tests/unit/<package>/ for each package of hetseq/ and nothing else
    (project/: the repository's own checks); test files named alike across
    folders are told apart by their packages (__init__.py)."""
    unit = ROOT / "tests" / "unit"
    folders = {p.name for p in unit.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {name.split(".")[1] for name in PACKAGES} | {"project"}
    for folder in [unit, *(unit / name for name in folders), ROOT / "tests" / "system"]:
        assert (folder / "__init__.py").is_file(), folder


def _said_imports(doc, order):
    """The packages a package's docstring says it imports ('imports base,
    store'), or None where it says 'the layers below' / 'every package below'."""
    said = re.search(r"[Ii]mports ([^.:]*)[.:]", doc).group(1)
    if "below" in said or "every" in said:
        return None
    return {f"hetseq.{word}" for word in re.findall(r"\w+", said) if f"hetseq.{word}" in order}


def test_each_packages_docstring_says_its_layer_what_it_imports_and_where_its_tests_are():
    """A package's __init__ says what it is, its layer (the map's), what it
    may import (the packages it names include every one it imports) and
    where its tests are (tests/unit/<package>/), within the docstring limit."""
    order, graph, wrong = layers(), import_graph(LIBRARY), []
    for package in sorted(order):
        doc = ast.get_docstring(ast.parse((LIBRARY / package.split(".")[1] /
                                           "__init__.py").read_text())) or ""
        layer = re.search(r"Layer (\d+)", doc)
        if not layer or int(layer.group(1)) != order[package]:
            wrong.append(f"{package}: says no layer, or another than the map's {order[package]}")
            continue
        if f"tests/unit/{package.split('.')[1]}/" not in doc or not re.search(r"[Ii]mports ", doc):
            wrong.append(f"{package}: says not what it imports, or not tests/unit/<package>/")
            continue
        said = _said_imports(doc, order)
        used = {package_of(t) for m, targets in graph.items() if package_of(m) == package
                for t in targets} & set(order) - {package}
        if said is not None and used - said:
            wrong.append(f"{package}: imports {sorted(used - said)}, which its docstring leaves out")
    assert wrong == []
