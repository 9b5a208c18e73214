"""docs/design.md's route of one update names exactly the HetSeq files one
update enters (traced by tests/machinery/route.py), and says how many: a
map that cannot drift from the code."""

import re

from machinery.route import trace
from machinery.settings import ROOT


def _route():
    """(the number the heading says, the files the route names in bold)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = re.search(r"^### The route of one update: (\d+) files\n(.*?)^## ", text,
                        re.S | re.M)
    return int(section.group(1)), re.findall(r"\*\*`(hetseq/[\w/]+\.py)`\*\*", section.group(2))


def test_the_design_route_names_the_files_one_update_enters():
    said, named = _route()
    entered = trace()
    assert len(named) == len(set(named)), "a file named twice"
    assert sorted(set(named) - set(entered)) == [], "named, but one update does not enter them"
    assert sorted(set(entered) - set(named)) == [], "entered by one update, but not named"
    assert said == len(entered)


def test_the_trace_sees_what_an_update_enters():
    """The tracer finds the Controller and the task's API, and nothing of a
    validation that the traced updates do not make."""
    entered = trace()
    assert "hetseq/update/controller.py" in entered and "hetseq/tasks/api.py" in entered
    assert "hetseq/run/validation.py" not in entered
    assert all(path.startswith("hetseq/") for path in entered)
