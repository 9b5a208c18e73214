"""Imported by the ranks' fork server only (launch.PRELOAD), never elsewhere.

The fork server holds the job's standard output and error (its ranks write
there), so whoever reads them sees their end only when it has exited. It
exits when the command that started it has, and the interpreter's teardown
with torch, torch._dynamo and FSDP loaded takes 1-3 s of CPU freeing modules:
an end with nothing to write or close comes first instead. Its ranks never
run this: a forked rank ends with os._exit, as multiprocessing's children do.
"""

import atexit
import os

atexit.register(os._exit, 0)
