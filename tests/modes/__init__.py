"""An exchange mode defined outside hetseq/ (issue 49), loaded with
``--user-dir tests/modes``; the toy task comes along from tests/tasks, so
one --user-dir gives a job both."""

import os

from hetseq.tasks import import_user_dir

import_user_dir(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tasks"))

from . import allreduce  # noqa: E402,F401  (registers --exchange allreduce)
