"""The mutation harness (bench/mutations.py) stays meaningful: every
mutation still applies to the source (its text once in all of hetseq/) and
names tests that exist, and only a named test failing on an assertion
counts as a catch."""

import os
import re
import sys

import pytest

from machinery.settings import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import mutations  # noqa: E402
# bench/ holds a package named 'tasks' too: left on sys.path, it would shadow
# tests/tasks for every later test in this process (an xdist worker's).
sys.path[:] = [p for p in sys.path if os.path.abspath(p) != str(ROOT / "bench")]


@pytest.mark.parametrize("name", sorted(mutations.MUTATIONS))
def test_every_mutation_applies_and_names_tests_that_exist(name):
    _, text, replacement, tests = mutations.MUTATIONS[name]
    assert mutations.locate(text), f"{name}: its text does not occur exactly once in hetseq/"
    assert text != replacement and tests
    for test in tests:
        file, _, function = test.partition("::")
        source = (ROOT / file).read_text()
        if function:
            assert re.search(rf"^def {re.escape(function.split('[')[0])}\(", source, re.M), test


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>
<testcase classname="tests.test_a" name="test_assert"><failure message="AssertionError: assert 1 == 2">x</failure></testcase>
<testcase classname="tests.test_a" name="test_raises[p]"><failure message="Failed: DID NOT RAISE &lt;class 'ValueError'&gt;">x</failure></testcase>
<testcase classname="tests.test_a" name="test_crash"><failure message="torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGABRT">x</failure></testcase>
<testcase classname="tests.test_a" name="test_fixture"><error message="failed on setup with ProcessExitedException">x</error></testcase>
</testsuite></testsuites>"""


@pytest.mark.parametrize("named, caught", [
    (["tests/test_a.py::test_assert"], True),
    (["tests/test_a.py::test_raises"], True),
    (["tests/test_a.py::test_crash"], False),        # a worker's crash proves nothing
    (["tests/test_a.py::test_fixture"], False),      # nor a fixture's error
    (["tests/test_b.py::test_assert"], False),       # nor another test's failure
])
def test_only_an_assertion_in_a_named_test_counts_as_caught(tmp_path, named, caught):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    assert mutations.verdict(str(junit), named)[0] is caught


def test_a_mutation_is_found_wherever_its_text_moved(tmp_path):
    """The table names no file: text that moves to another module is found
    there, and text in two places (or none) applies nowhere."""
    (tmp_path / "hetseq" / "sub").mkdir(parents=True)
    (tmp_path / "hetseq" / "a.py").write_text("x = 1\n")
    (tmp_path / "hetseq" / "sub" / "b.py").write_text("y = 2\nz = 3\n")
    assert mutations.locate("y = 2", tmp_path) == os.path.join("hetseq", "sub", "b.py")
    (tmp_path / "hetseq" / "a.py").write_text("x = 1\ny = 2\n")
    assert mutations.locate("y = 2", tmp_path) is None
    assert mutations.locate("w = 4", tmp_path) is None
