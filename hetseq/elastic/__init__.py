"""Elastic jobs (--elastic): nodes that come and go. The run's one door to
membership for a member (hooks.py; the run declares it in run/seam.py) and
the node's loop over generations (agent.py); the
members' meeting and its rules (membership, rounds, generations, place) and
the watchdog that cuts a silent member off. Nothing is imported here, so
importing the seam loads none of the rest."""
