"""``Elastic``: the run's door to membership (run/seam.py) for an elastic
member, carrying its run through its generation; agent.py asks
``snapshot()`` at the end. Under --zero 1/2/3 a snapshot is the newest
*full* state (docs/elastic.md)."""

import collections
import copy

from hetseq.run.seam import GenerationOver, Reconfigure
from hetseq.distributed.collectives import broadcast_from
from hetseq.checkpoints.keys import CONTROLLER, UPDATES
from hetseq.base.sections import Section, flag, section

RECORD = "elastic"     # the checkpoint's entry: the generation's lineage and members


class Elastic:
    """An elastic member's run in one generation. ``place``: its Place
    (rank, store, heartbeats); ``held()``: the state this process holds
    (the source's goes to every rank)."""

    members_change = True  # a saved split was for other members; B stays fixed

    def __init__(self, place, held, split=False):
        """``split``: the run's state will be split between ranks (--zero
        1/2/3, more than one rank; attach checks the Controller's word)."""
        self.place, self._held = place, held
        self.split = split
        self._kept_at = None         # the update of the full state last kept
        self._full = None            # split state: the newest full state kept (first process only)
        self._received = None        # the state this generation started from (split state)
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
        check = on_line(gen.members[gen.source]["lineage"])

        def received(state):
            refusal = check(state)
            if refusal is None and self._keeps():
                # A copy: the optimizer may take the loaded tensors as its own
                # and change them in place.
                self._received = copy.deepcopy(state)
            return refusal
        return gen.source_rank, self._held, received

    def entries(self):
        return {RECORD: self.place.record()}

    def attach(self, controller, data, local_state):
        """``local_state(position, controller_state)``: the run's state in
        the checkpoint format, with no collective."""
        self.controller, self._data, self._local_state = controller, data, local_state
        self._completed.append((controller.num_updates, data.state_dict()))
        self.split = self.split and controller.state_shares()[0] is not None
        if self.split and self._received is not None:
            # The state this generation started from, under this
            # generation's lineage (as a snapshot taken now would be: the
            # line keeps this generation, whose checkpoints stay on it). A
            # fresh start has none to keep: every member then offers none,
            # and the next generation starts afresh too.
            self._full = {**self._received, RECORD: self.place.record()}
        self._received = None

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
        """After the update's validation and save: under a split state, the
        full state kept before a join (every rank reaches this update and
        reads the same signal)."""
        if self.split and self._reconfigure:
            self._keep_full()
        if self._reconfigure:
            raise Reconfigure()

    def saved(self):
        """The run saved (every rank): under a split state the full state
        is kept too, so a lost member costs the updates since the last save."""
        if self.split:
            self._keep_full()

    def _keeps(self):
        """Whether this process keeps a full state: its node's first process
        (the node offers one state; its other processes would hold copies)."""
        return self.split and self.place.local == 0

    def _keep_full(self):
        """The full state of the update just completed, taken by every rank
        together (the Controller's collective gathers it to rank 0) and sent
        from rank 0 to all; replaced only once it arrived whole, so a member
        lost meanwhile leaves the previous one. Once per update (a save
        and a join may fall on the same one)."""
        if self._kept_at == self.controller.num_updates:
            return
        self._kept_at = self.controller.num_updates
        controller_state = self.controller.state_dict()      # full on rank 0 only
        position = self._position()
        state = broadcast_from(0, lambda: self._local_state(position, controller_state),
                               self.controller.ctx)
        if self._keeps():
            self._full = state

    def went_back(self):
        """Under a split state, once the generation ended: (updates this
        rank completed, updates of the full state it offers), or None."""
        if not self.split or self.controller is None:
            return None
        kept = -1 if self._full is None else self._full[CONTROLLER.name][UPDATES]
        return self.controller.num_updates, max(kept, 0)

    def snapshot(self):
        """The state of the last update this rank completed, without a
        collective (the process group may be broken). The optimizer steps
        only after the update's collectives, so the model is either at the
        last completed update or one further, when this rank finished an
        update the others did not (under --local-steps an update is a
        round: one cut short is undone, Controller.state_dict). A rank that
        sits out offers the state of the last update it took part in (its
        model has not moved since: update/members.py): behind the members',
        never ahead. Under a split state: the newest full state kept (None
        on a node's other processes, or after a fresh start)."""
        if self.split:
            return self._full
        return self._left if self.controller.members.sitting else self._now()

    def _now(self):
        """The state of the last update this rank completed (``snapshot``)."""
        state = self.controller.state_dict(local=True)     # may go back a round
        return self._local_state(self._position(), state)

    def _position(self):
        """The data position of the Controller's update: one of the last two
        completed; not one of them, an update this rank completed and the
        others did not (it holds one more): the position after the batch it
        drew."""
        return dict(self._completed).get(self.controller.num_updates, self._drawn)


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


@section
class ElasticConfig(Section):
    """Nodes that come and go (hetseq/elastic/)."""
    elastic: bool = flag(False, action="store_true",
                         help="nodes may join and leave while the job trains (docs/elastic.md): "
                              "ranks are given out at the meeting point; needs a job secret, "
                              "--global-batch-size and a tcp:// meeting point")
    min_nodes: int = flag(1, type=int, metavar="N",
                          help="--elastic: train only with at least N nodes; below, wait up to "
                               "--distributed-timeout, then save and stop (default: 1)")
    max_nodes: int = flag(0, type=int, metavar="M",
                          help="--elastic: at most M nodes take part (0: no limit)")
    # A member silent this long is lost (elastic/watchdog.py).
    heartbeat_timeout: float = flag(5.0, type=float, metavar="SECONDS",
                                    help="--elastic: a member whose heartbeat stood still this "
                                         "long is lost (its connections are cut, so a collective "
                                         "waiting on it ends at once); --distributed-timeout "
                                         "then bounds a slow step only (default: 5; 0: only "
                                         "--distributed-timeout tells)")
