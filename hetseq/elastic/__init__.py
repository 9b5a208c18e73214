"""Elastic jobs (--elastic): nodes that come and go. The run's one door to
membership (seam.py) and the node's loop over generations (node.py); the
members' meeting and its rules (membership, rounds, generations, place) and
the watchdog that cuts a silent member off. Nothing is imported here, so
importing the seam loads none of the rest."""
