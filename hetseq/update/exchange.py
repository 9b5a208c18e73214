"""What an exchange mode is: how the ranks' gradients become the job's update.

A mode is a class registered in ``EXCHANGES`` (``@register_exchange("name")``),
one per job (``--exchange``): it owns its flags (``Config``), supplies the
hooks of ``Exchange`` below for what it changes, and reads the update only
through ``Updates`` (docs/design.md, 'Exchange modes and slow links').
"""

import copy
import dataclasses
import time

from hetseq.base.errors import UserError
from hetseq.base.registry import Registry
from hetseq.base.sections import Section, given_flags, section
from hetseq.update.stats import RankReport, StatsSum, StepResult


class Updates:
    """What an exchange mode may read of the job's updates (the Controller
    behind a narrow door, read-only): the parameters, the model, the rate,
    a copy of where the updates stand, the replicated state. The Controller
    steps, counts and goes back; a mode only says when and to which mark."""

    def __init__(self, controller):
        self._controller = controller

    @property
    def params(self):
        """The trainable parameters, in the same order on every rank."""
        return self._controller.params

    @property
    def model(self):
        """The model as built (unwrapped): what its sharded state is read from."""
        return self._controller.model

    @property
    def lr(self):
        """The learning rate of the next update."""
        return self._controller.lr

    def mark(self):
        """Where the updates stand, to go back to (``Exchange.settle`` returns
        it): a copy of the optimizer's state and the count."""
        controller = self._controller
        return copy.deepcopy(controller.optimizer.state_dict()), controller.num_updates

    def replicated(self):
        """The tensors the --zero mode keeps a copy of on every rank."""
        controller = self._controller
        return controller.sharding.replicated_state(controller.params, controller.optimizer)


@section
class NoFlags(Section):
    """The section of a mode without flags of its own."""


class Exchange:
    """The base of every mode. The Controller's ``train_step`` runs the
    update (docs/design.md, "One update"); a mode supplies hooks for what it
    changes: how the gradients and the stats travel, what ends an update (a
    round's exchange). ``begin`` and ``finish`` are templates a mode does
    not override: they put this rank's figures in the stats and record them."""
    Config: type[Section] = NoFlags        # its section of the job's ExchangeConfig (its flags)
    sits_out = False        # True: a rank may leave its exchange (update/members.py)
    updates_per_exchange = 1
    # True: the --zero mode it holds may split the state by memory
    # (--state-shares memory, update/zero/uneven.py): it wraps the model as built.
    shares_by_memory = True
    # True: each update is this rank's own inner step (its stats stay here,
    # it counts whether or not it stepped); ``end`` makes the exchange.
    inner_steps = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for template in ("begin", "finish"):
            if template in vars(cls):
                raise TypeError(f"exchange mode {cls.__name__} overrides {template}, a "
                                "template that records this rank's figures: supply the hooks "
                                "(stats, sum_gradients, end) instead")

    # ---- its flags (classmethods: the parser's, before any run) ----

    @classmethod
    def add_args(cls, group):
        """Its flags: the ``flag`` fields of ``Config`` (a Section, sections.py),
        declared there once."""
        if issubclass(cls.Config, Section):
            cls.Config.add_args(group)

    @classmethod
    def asks(cls, args):
        """The flag that asks for this mode when --exchange is not given
        (e.g. '--local-steps 8'), or None."""
        return None

    @classmethod
    def check_args(cls, args, defaults, chosen):
        """Refuse what makes no sense (a UserError, exit 2). ``chosen``: the
        job runs this mode; else its flags must keep their defaults."""
        if not chosen:
            given = given_flags(args, defaults, [f.name for f in dataclasses.fields(cls.Config)])
            if given:
                raise UserError(f"{', '.join(given)} set exchange mode '{cls.registered_name}'; "
                                f"add --exchange {cls.registered_name}")

    # ---- building ----

    def __init__(self, cfg, precision_cfg, ctx, rewindable=False):
        """``cfg``: its Config; ``rewindable``: --elastic, whose snapshots go
        back to the last update every rank completed (``settle(local=True)``)."""
        self.cfg, self.precision, self.ctx = cfg, precision_cfg, ctx
        self.rewindable = rewindable
        # Every --zero mode averages over the world (controller.py's math).
        self.divisor = ctx.world_size if ctx.distributed else 1
        self.updates = None            # Updates, from attach
        self._last = (0.0, 0.0, 0.0)   # this rank's compute seconds, samples, wall, last update
        self._since = [0.0, 0.0]       # compute seconds and samples since then (a round's)
        self._ended = None             # when this rank's last update ended
        self._report = RankReport()    # what this rank sends with the update under way

    def comm_hook(self):
        """Hook: (state, hook) for DDP's gradient all-reduce, or None for its own."""
        return None

    def train_under(self, zero):
        """Hook: the sharding the ranks train under, given the job's --zero
        mode (``zero``, built with ``comm_hook()``)."""
        return zero

    def attach(self, updates):
        """``updates``: Updates, once the model is wrapped and the optimizer built."""
        self.updates = updates

    # ---- one update: templates (the Controller calls them) ----

    def begin(self, checksum, signal, stop=0.0):
        """Before an update's first forward: its StatsSum, carrying this
        rank's report (the figures of the last update that ended)."""
        self._report = RankReport(*self._last, checksum, signal, stop)
        return self.stats(self._report)

    def finish(self, stats, made, norm, seconds, boundary):
        """After the step (``made``, ``norm``): the mode's ``end``, and this
        rank's figures recorded whenever an update (a round) ended, since
        rebalancing reads them. ``seconds``: this rank's compute time."""
        self._since[0] += seconds
        self._since[1] += stats.own_samples()
        ended = time.perf_counter()    # the update's end: before a round's exchange
        result = self.end(stats, made, norm, boundary)
        if result is not None:
            self._last = (*self._since, self._wall(ended))
            self._since = [0.0, 0.0]
        return result

    def forget_round(self):
        """A round cut short (``settle(local=True)``): its figures go with it."""
        self._since = [0.0, 0.0]

    def _wall(self, now):
        """Wall seconds from the end of this rank's last update (round) to
        ``now`` (0: the first), and ``now`` becomes that end."""
        ended, self._ended = self._ended, now
        return now - ended if ended is not None else 0.0

    # ---- one update: hooks (the default: every update summed over the ranks) ----

    def stats(self, report):
        """Hook: the update's StatsSum; by default summed over the ranks with
        ``report`` (this rank's RankReport) in one all-reduce."""
        return StatsSum(self.ctx, report)

    def sum_gradients(self):
        """Hook, after the last backward: sum the gradients the --zero mode did
        not (by default it did, inside backward)."""

    def end(self, stats, made, norm, boundary):
        """Hook, after the step: the StepResult the run sees, or None when
        the mode has none yet (inside a round). ``boundary``: the run needs
        one model after this update (it validates, saves or stops)."""
        totals, ranks = stats.result()
        return StepResult(totals, ranks, self.updates.lr, made, norm)

    # ---- agreement and checkpoints ----

    def replicated(self):
        """The tensors every rank holds a copy of (agreement.py keeps them equal)."""
        return self.updates.replicated()

    def settle(self, local=False):
        """Before the state is read: the model of the last complete exchange.
        By default what is in flight lands (perhaps a collective); ``local``
        (an elastic snapshot, the group perhaps broken): no collective, an
        update begun and not completed on every rank is undone. Returns the
        ``Updates.mark()`` the Controller goes back to, or None."""
        return None

    def drain(self):
        """This rank stops on an error of its own (its data, its disk): what
        it already sent completes first, with no new collective, so the
        members keep it."""

    def state_dict(self, optimizer_state, local=False):
        """Its entries in the Controller's state (checkpoints/keys.py's mode_key);
        ``optimizer_state``: the Controller's (this rank's, or rank 0's
        gathered); ``local``: this rank's own view, for a snapshot."""
        return {}

    def state_kind(self, optimizer):
        """{entry: its kind} for its entries in the Controller's state
        (hetseq/checkpoints/state.py), checked before anything loads; ``optimizer``: the
        kind of the Controller's optimizer state (a held.OptimizerState)."""
        return {}

    def load_state_dict(self, state):
        """From the Controller's saved state (entries a reset left out are absent)."""

    def resumed_optimizer(self, state, saved):
        """The optimizer state this rank loads; ``saved``: the (one) saved one."""
        return saved


EXCHANGES = Registry("exchange mode", base=Exchange,
                     hint=" (a mode of your own: a module of --user-dir that registers it)")


def register_exchange(name):
    """Decorator: ``@register_exchange("name")`` on a subclass of Exchange."""
    return EXCHANGES.register(name)


def refuse(prefix, refused):
    """The first (bad, message) that is bad, as one UserError."""
    for bad, message in refused:
        if bad:
            raise UserError(f"{prefix}: {message}")
