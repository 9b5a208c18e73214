"""The application top: hetseq-train's command (main.py), the parser and
the two configurations built from it, the flags' page, and the digests of
the job's identity.
Layer 15: imports every package but launch/. Tests: tests/unit/app/, tests/system/."""
