"""Task registry and ``--user-dir`` loading (the Task API: api.py)::

    from hetseq.tasks import Task, register_task

    @register_task("mytask")
    class MyTask(Task): ...

Layer 12: imports base, update, bert.
Tests: tests/unit/tasks/, tests/system/."""

import importlib
import os
import sys

from hetseq.base.errors import UserError
from hetseq.base.owned_file import refuse_unless_owned
from hetseq.tasks.api import TASKS, Task, register_task

__all__ = ["TASKS", "Task", "import_builtin_tasks", "import_user_dir", "register_task"]

# Built-in tasks register themselves on import.
_BUILTIN_MODULES = ("hetseq.tasks.bert_pretraining", "hetseq.tasks.glue")


def import_builtin_tasks():
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def import_user_dir(path):
    """Import the directory ``path`` as a package so its tasks register.

    The directory's parent goes on ``sys.path`` and the directory is imported
    by its name (as fairseq does), so the package may use relative imports.
    Importing it again (e.g. in a spawned worker) is a no-op.
    """
    if not path:
        return
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise UserError(f"--user-dir {path}: no such directory; pass the folder that holds "
                        "your task modules (it needs an __init__.py that imports them)")
    parent, name = os.path.split(path)
    # Its modules run, and its parent goes first on sys.path (where any
    # module not yet imported is looked up first): another user who could
    # change either would choose the code of the job.
    refuse_unless_owned(parent, f"--user-dir {path}: its parent folder (on the module path)")
    refuse_unless_owned(path, "--user-dir")
    # (Links to folders followed: Python imports through them; a folder seen
    # twice, a link's cycle, once.)
    seen = set()
    for folder, subfolders, files in os.walk(path, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        refuse_unless_owned(folder, "--user-dir's folder")
        for entry in files:
            if entry.endswith((".py", ".pyc")):        # (a cached .pyc runs as its source)
                refuse_unless_owned(os.path.join(folder, entry), "--user-dir's module")
    module = sys.modules.get(name)
    if module is not None:
        # A package knows its folder by __path__; a plain folder (a namespace
        # package) has no __file__ at all.
        if path in {os.path.abspath(p) for p in getattr(module, "__path__", [])}:
            return
        raise UserError(f"--user-dir {path}: a different module named '{name}' is already "
                        "imported; rename the directory")
    if parent not in sys.path:
        sys.path.insert(0, parent)
    module = importlib.import_module(name)
    found = {os.path.abspath(p) for p in getattr(module, "__path__", [])}
    if path not in found:
        del sys.modules[name]
        first = sorted(found)[:1] or module
        raise UserError(f"--user-dir {path}: importing '{name}' found {first} "
                        "first on the module path; rename the directory")
    if not os.path.exists(os.path.join(path, "__init__.py")):
        # A plain folder of modules: import each one so its tasks register.
        for entry in sorted(os.listdir(path)):
            if entry.endswith(".py") and not entry.startswith("_"):
                importlib.import_module(f"{name}.{entry[:-3]}")


__all__ = ["Task", "TASKS", "register_task", "import_user_dir", "import_builtin_tasks"]
