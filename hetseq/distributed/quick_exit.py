"""Imported by the ranks' fork server only (spawn.PRELOAD): it ends with
os._exit once the command that started it has, not with the interpreter's
teardown of torch.

Why, for users: the fork server holds the job's standard output, so whatever
reads it (``| tee log``, a CI log, ``subprocess.run``) sees the job end only
when the server has exited; bench/rank_start.py measures the difference.
Its ranks never run this: a forked rank ends with os._exit, as
multiprocessing's children do. It also freezes what the server imported
(below), and ignores SIGTERM (next to it).
"""

import atexit
import gc
import os
import signal

atexit.register(os._exit, 0)
# SIGTERM to a node's whole process group (hetseq-launch's wrapper) must not
# end the server its ranks report their end through while they save
# (base/stopping.py); it ignores SIGINT already. A forked rank has its own.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
# Imported after torch (spawn.PRELOAD): what the server imported so far goes
# to the collector's permanent generation, so that no rank's collection
# walks it and has the kernel copy every page it sits on (spawn._frozen_for).
gc.collect()
gc.freeze()
