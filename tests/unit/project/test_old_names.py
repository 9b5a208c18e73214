"""What users and other hosts rely on keeps working after the layout moved
(issue 59, item 3): the documented import paths, the console scripts'
entry points (an old install's scripts name the old modules), and the
modules remote hosts run with ``python -m``."""

import importlib
import importlib.util
import sys
import warnings

import pytest

from machinery.settings import ROOT

# Old name -> the module it now is (a shim that warns and steps aside).
MOVED = {"hetseq.errors": "hetseq.base.errors", "hetseq.sections": "hetseq.base.sections",
         "hetseq.randomness": "hetseq.keyed.randomness", "hetseq.nn": "hetseq.keyed.nn",
         "hetseq.main": "hetseq.app.main", "hetseq.launch.main": "hetseq.launch.launcher"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_name_is_the_new_module_and_says_so(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} is deprecated: import {MOVED[old]}"]


def test_the_documented_names_import_from_where_the_docs_say():
    from hetseq.nn import Dropout
    from hetseq.randomness import sample_keys
    from hetseq.sections import Section, flag, section
    from hetseq.tasks import Task, register_task
    from hetseq.update.exchange import Exchange, register_exchange
    from hetseq.update.stats import StepResult
    assert all([Dropout, sample_keys, Section, flag, section, Task, register_task, Exchange,
                register_exchange, StepResult])


def _entry_points():
    import ast
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.keyword)
                and node.arg == "entry_points")
    return ast.literal_eval(call.value)["console_scripts"]


@pytest.mark.parametrize("line", _entry_points())
def test_every_console_script_names_a_function(line):
    name, _, target = line.partition("=")
    module, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module), function)), line


@pytest.mark.parametrize("old", ["hetseq.main:main", "hetseq.launch.main:main"])
def test_an_old_installs_scripts_still_start(old):
    module, _, function = old.partition(":")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert callable(getattr(importlib.import_module(module), function))


@pytest.mark.parametrize("module", ["hetseq.launch.node", "hetseq.launch.probe"])
def test_what_remote_hosts_run_is_where_they_run_it(module):
    """hetseq-launch starts ``python -m`` of these on every host (transport.py)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin.endswith(module.replace(".", "/") + ".py")
    source = open(spec.origin).read()
    assert 'if __name__ == "__main__":' in source


@pytest.mark.parametrize("old", ["hetseq.main", "hetseq.launch.main"])
def test_an_old_command_name_still_runs_as_a_program(old):
    """``python -m hetseq.main --help`` is hetseq-train's help, as it was."""
    import subprocess
    done = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-m", old,
                           "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
