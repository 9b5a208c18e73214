"""Helpers for tests and benchmarks, kept out of the installed library and of
the job identity (hetseq/app/digests.py): imported as ``machinery.*`` with tests/
on sys.path (tests/conftest.py's folder; bench scripts insert it)."""
