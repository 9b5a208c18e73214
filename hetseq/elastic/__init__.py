"""Elastic jobs (--elastic): nodes that come and go. The run's door for a
member (hooks.py; the run declares it in run/seam.py), the node's loop over
generations (agent.py), the members' meeting and its rules (membership,
rounds, generations, place) and the watchdog that cuts a silent member off.
Layer 14: imports the run and the layers below.
Tests: tests/unit/elastic/, tests/system/."""
