"""The run's one door to membership (torchft's Manager, in a few verbs),
declared here by the run that calls it: ``Fixed`` for a job without
--elastic does nothing; elastic/hooks.py's ``Elastic`` carries a member's
run through its generation. The loop calls, in order:
``source``/``members_change``/``entries()`` at restore, ``attach`` once
restored, ``begin_update``, ``raise_if_over`` between inner steps,
``completed`` after an update, ``raise_if_joining`` after its events, and
``saved`` after each save."""


class Reconfigure(Exception):
    """Raised at an update boundary when a node asked to join."""


class GenerationOver(Exception):
    """Raised between inner steps of --local-steps when the heartbeats know
    the generation is over: the round would be trained again anyway, and
    its end would only come (and fail) a round's compute later."""


class Fixed:
    """A job without --elastic: its members never change; nothing to do."""

    source = None          # rank 0 reads --restore-file
    members_change = False

    def entries(self):
        return {}

    def attach(self, controller, data, local_state):
        pass

    def begin_update(self):
        return 0.0

    def raise_if_over(self):
        pass

    def completed(self, result):
        pass

    def raise_if_joining(self):
        pass

    def saved(self):
        pass


FIXED = Fixed()
