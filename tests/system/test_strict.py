"""Under HETSEQ_TEST_STRICT=1 (set by .ci/run) a test whose needs are missing
fails; elsewhere it skips and says why."""

import pytest

from machinery.settings import ROOT

pytest_plugins = ["pytester"]

NEEDY = f"""
import sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
from machinery.settings import require, require_module

def test_needs_a_tool():
    require(False, "needs a tool this machine lacks")

def test_needs_a_package():
    require_module("no_such_package_hetseq")
"""


@pytest.mark.parametrize("strict", ["1", ""])
def test_missing_needs_fail_in_ci_and_skip_elsewhere(pytester, monkeypatch, strict):
    monkeypatch.setenv("HETSEQ_TEST_STRICT", strict)
    pytester.makepyfile(test_needy=NEEDY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    if strict:
        result.assert_outcomes(failed=2)
        result.stdout.fnmatch_lines(["*needs a tool this machine lacks (HETSEQ_TEST_STRICT=1*"])
    else:
        result.assert_outcomes(skipped=2)
        result.stdout.fnmatch_lines(["*needs a tool this machine lacks*"])
