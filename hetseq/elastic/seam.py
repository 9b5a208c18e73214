"""The training loop's one door to membership (torchft's Manager, in a few
verbs). ``Run`` (run/loop.py) makes the same calls whatever the job:
``Fixed`` for a job without --elastic does nothing, ``Elastic`` carries a
member's run through its generation (node.py starts one per generation).

What the loop asks, in its order:

- ``source``, ``replans``, ``entries()``: where the run's state comes from
  (Checkpointer.restore), whether the saved split of the batch is dropped,
  what a checkpoint keeps beside the components;
- ``attach(controller, data, local_state)``: once the state is restored;
- ``begin_update()``: the update's batches are drawn; its word in the stats;
- ``raise_if_over()``: between inner steps of --local-steps (GenerationOver);
- ``completed(result)``: after an update, once its plan is observed;
- ``raise_if_joining()``: after the update's validation and save (Reconfigure).

node.py asks ``Elastic.snapshot()`` when the generation ends.
"""

import collections

RECORD = "elastic"     # the checkpoint's entry: the generation's lineage and members


class Reconfigure(Exception):
    """Raised at an update boundary when a node asked to join."""


class GenerationOver(Exception):
    """Raised between inner steps of --local-steps when the heartbeats know
    the generation is over: the round would be trained again anyway, and
    its end would only come (and fail) a round's compute later."""


class Fixed:
    """A job without --elastic: its members never change; nothing to do."""

    source = None          # rank 0 reads --restore-file
    replans = False

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


FIXED = Fixed()


class Elastic:
    """An elastic member's run in one generation. ``place``: its Place
    (rank, store, heartbeats); ``held()``: the state this process holds
    (the source's goes to every rank)."""

    replans = True         # the saved split was for other members

    def __init__(self, place, held):
        self.place, self._held = place, held
        self.controller = self._data = self._local_state = None
        # (updates, data position) at the last two completed updates (rounds):
        # a snapshot goes back to one of them (--outer-overlap: two rounds).
        self._completed = collections.deque(maxlen=2)
        self._drawn = None           # the position once the update under way drew its batches
        self._left = None            # sitting out: the state of the update it left
        self._reconfigure = False

    @property
    def source(self):
        """(rank, make, check): the rank the round chose, what it holds, and
        the lineage every rank requires of it."""
        gen = self.place.generation
        return gen.source_rank, self._held, on_line(gen.members[gen.source]["lineage"])

    def entries(self):
        return {RECORD: self.place.record()}

    def attach(self, controller, data, local_state):
        """``local_state(position, controller_state)``: the run's state in
        the checkpoint format, with no collective."""
        self.controller, self._data, self._local_state = controller, data, local_state
        self._completed.append((controller.num_updates, data.state_dict()))

    def begin_update(self):
        """The update's batches are drawn. Returns this rank's word in its
        stats: 1.0 when a node asked to join (rank 0 reads its store)."""
        self._drawn = self._data.state_dict()
        return float(self.place.join_waiting())

    def raise_if_over(self):
        """Between inner steps no collective runs that could fail: the
        heartbeats' word ends the generation (Place.over)."""
        if self.place.over():
            raise GenerationOver()

    def completed(self, result):
        """After an update: whether a node waits to join; and, for a rank
        the plan now leaves out, its offer (the update it left)."""
        self._reconfigure = any(result.ranks.signal)
        sitting = self.controller.members.sitting
        self._left = (self._left or self._now()) if sitting else None
        self._completed.append((self.controller.num_updates, self._drawn))

    def raise_if_joining(self):
        if self._reconfigure:
            raise Reconfigure()

    def snapshot(self):
        """The state of the last update this rank completed, without a
        collective (the process group may be broken). The optimizer steps
        only after the update's collectives, so the model is either at the
        last completed update or one further, when this rank finished an
        update the others did not (under --local-steps an update is a
        round: one cut short is undone, Controller.state_dict). A rank that
        sits out offers the state of the last update it took part in (its
        model has not moved since: update/members.py): behind the members',
        never ahead."""
        return self._left if self.controller.members.sitting else self._now()

    def _now(self):
        """The state of the last update this rank completed (``snapshot``)."""
        state = self.controller.state_dict(local=True)     # may go back a round
        # Not one of them: an update this rank completed and the others did
        # not (it holds one more); the position after the batch it drew.
        position = dict(self._completed).get(self.controller.num_updates, self._drawn)
        return self._local_state(position, state)


def on_line(lineage):
    """A check of a state received from a peer (Checkpointer.restore): it
    must carry ``lineage``, the one the round agreed on; else every rank
    refuses it (a state off the job's line). Returns why it is refused."""
    def check(state):
        got = (state.get(RECORD) or {}).get("lineage", [])
        if list(got) != list(lineage):
            return (f"is not the state the members agreed on (its lineage ends {got[-1:]}, "
                    f"expected {list(lineage)[-1:]}): not on this job's line")
        return None
    return check
