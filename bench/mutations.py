#!/usr/bin/env python
"""Proof that the tests bite: break each promise of the README on purpose,
one at a time, and run the tests that pin it; every one must fail, on an
assertion (a mutation that only makes a fixture or a worker crash is not
counted as caught: the crash could have another cause).

Each mutation replaces one piece of text in a copy of the repository (the
committed tree, in a temporary folder) and runs the named tests there. The
text is found wherever it is in hetseq/ (it must occur once there), so code
that moves between modules keeps its mutations.
Prints JSON: for each mutation, the promise, the tests run and whether they
failed (``caught``). docs/testing.md lists the same promises.

    python bench/mutations.py [--only NAME ...] [--tier unit [--coverage FILE]] [--jobs N]
                              [--out FILE]

About 15 minutes for all on 2 cores, the control run (the same tests on
the unchanged tree, which must pass) included. ``--tier unit`` runs, for
each mutation, the fast tier of the package it breaks (tests/unit/<package>/)
instead of the named tests: how much the loop of changing code catches;
with ``--coverage`` (``coverage run`` of tests/unit with ``dynamic_context =
test_function``) also every unit test that ran the mutated lines.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from output import emit  # noqa: E402

from mutation_table import MUTATIONS  # noqa: E402  (bench/mutation_table.py)


SEARCHED = "hetseq"


def locate(text, root=ROOT):
    """The one file under hetseq/ that holds ``text``, which must occur
    exactly once in all of them (a mutation that no longer applies, or
    applies in two places, would prove nothing), else None. The table names
    no file: moving code between modules leaves a mutation applying."""
    found = []
    for folder, _, names in os.walk(os.path.join(root, SEARCHED)):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    found += [os.path.relpath(path, root)] * f.read().count(text)
    return found[0] if len(found) == 1 else None


def verdict(junit_xml, tests):
    """(caught, why) from pytest's JUnit XML: caught only when one of the
    named tests FAILED on an assertion (an assert, pytest.raises or
    pytest.fail), not when a fixture, a worker or the collection errored."""
    import xml.etree.ElementTree as ET
    named = {(t.split("::", 1)[0], t.split("::", 1)[1].split("[", 1)[0])
             for t in tests if "::" in t}
    files = {t for t in tests if "::" not in t}
    folders = tuple(f.rstrip("/") + "/" for f in files if not f.endswith(".py"))
    why = []
    for case in ET.parse(junit_xml).iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            continue
        name = case.get("name", "").split("[", 1)[0]
        module = case.get("classname", "").replace(".", "/") + ".py"
        message = failure.get("message", "")
        asserted = message.startswith(("assert", "AssertionError", "Failed", "Failed:")) or \
            "DID NOT RAISE" in message or failure.text and "AssertionError" in failure.text
        if asserted and ((module, name) in named or module in files or module.startswith(folders)):
            why.append(f"{case.get('name')}: {message.splitlines()[0][:200] if message else ''}")
    return bool(why), why[:2]


def unit_tier(text, covered=None):
    """The fast tier of the package whose file holds ``text``
    (tests/unit/<package>/), and with ``covered`` (a coverage file of
    tests/unit, contexts by test function) every unit test that ran one of
    the lines ``text`` spans, wherever it is."""
    path = locate(text) or ""
    parts = path.split(os.sep)
    tests = [f"tests/unit/{parts[1]}"] if len(parts) > 2 else []
    if covered is not None and path:
        with open(os.path.join(ROOT, path)) as f:
            source = f.read()
        first = source[:source.index(text)].count("\n") + 1
        lines = range(first, first + text.count("\n") + 1)
        by_line = covered.contexts_by_lineno(covered_name(covered, path))
        for context in sorted({c for line in lines for c in by_line.get(line, ()) if c}):
            module, _, function = context.rpartition(".")
            test = f"tests/{module.replace('.', '/')}.py::{function}"
            if not test.startswith(tuple(t + "/" for t in tests)):
                tests.append(test)
    return tests


def covered_name(covered, path):
    """The coverage file's name for ``path`` (it may have measured another copy)."""
    return next((f for f in covered.measured_files() if f.endswith(os.sep + path)), path)


def read_coverage(path):
    from coverage import CoverageData          # (pip install coverage: only for --coverage)
    covered = CoverageData(path)
    covered.read()
    return covered


def run(name, promise, text, replacement, tests, pytest_args=()):
    """Runs ``tests`` in a copy of HEAD where ``text`` reads ``replacement``
    (``text`` None: the copy unchanged, the control run)."""
    with tempfile.TemporaryDirectory() as copy:
        # Folders as a checkout has them (755): git archive's default 775 would
        # make tests/ writable by the group, and --user-dir tests/tasks refused.
        archive = subprocess.run(["git", "-C", ROOT, "-c", "tar.umask=0022", "archive", "HEAD"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", copy], input=archive, check=True)
        path = None
        if text is not None:
            path = locate(text, copy)
            if path is None:
                return {"name": name, "promise": promise, "error": "text not found once in hetseq/"}
            target = os.path.join(copy, path)
            with open(target) as f:
                source = f.read()
            with open(target, "w") as f:
                f.write(source.replace(text, replacement))
        start = time.time()
        junit = os.path.join(copy, "junit.xml")
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={junit}", *pytest_args, *tests], cwd=copy, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": copy}, timeout=1800)
        lines = done.stdout.strip().splitlines() or [""]
        caught, why = verdict(junit, tests) if os.path.exists(junit) else (False, [])
        return {"name": name, "promise": promise, "file": path, "tests": tests,
                "caught": caught, "returncode": done.returncode, "pytest": lines[-1], "why": why,
                "seconds": round(time.time() - start, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutation names (default: all)")
    parser.add_argument("--tier", choices=["named", "unit"], default="named",
                        help="named: each mutation's own tests; unit: its package's tests/unit/")
    parser.add_argument("--coverage", help="with --tier unit: a coverage file of tests/unit "
                        "(dynamic_context = test_function); each mutation also runs the unit "
                        "tests that ran its lines, in any package")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once")
    parser.add_argument("--out")
    opts = parser.parse_args()
    names = opts.only or list(MUTATIONS)
    covered = read_coverage(opts.coverage) if opts.coverage else None
    chosen = {name: MUTATIONS[name][3] if opts.tier == "named"
              else unit_tier(MUTATIONS[name][1], covered) for name in names}
    # One process each for the fast tier: its files take seconds, xdist's start more.
    args = ("-n", "0") if opts.tier == "unit" else ()
    # The control: the same tests on the unchanged tree must pass, or a failure
    # under a mutation proves nothing.
    tests = sorted({t for name in names for t in chosen[name]})
    control = run("control", "the unchanged tree passes the same tests", None, None, tests, args)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(opts.jobs) as pool:
        results = list(pool.map(lambda name: run(name, *MUTATIONS[name][:3], chosen[name], args)
                                if chosen[name] else {"name": name, "error": "no unit tier"},
                                names))
    emit({"tier": opts.tier, "control_passed": control["returncode"] == 0, "control": control,
          "mutations": results, "caught": sum(bool(r.get("caught")) for r in results),
          "of": len(results)}, opts.out)


if __name__ == "__main__":
    main()
