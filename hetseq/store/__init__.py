"""The job's authenticated store (jobs with a secret): the sealed channel,
the gate in front of it, the store's data and protocol, the job secret
and its rules, hetseq-secret.
Layer 4: imports base. Tests: tests/unit/store/, tests/system/."""
