"""What an exchange mode is: how the ranks' gradients become the job's update.

A mode is a class registered in ``EXCHANGES`` (``@register_exchange("name")``),
one per job (``--exchange``): it owns its flags (``Config``) and reaches the
update only through ``Updates``. ``Exchange`` below is what the Controller
calls (docs/design.md, 'Exchange modes and slow links', gives the order).
"""

import copy
import dataclasses
import time

from hetseq.base.errors import UserError
from hetseq.base.registry import Registry
from hetseq.base.sections import Section, given_flags, section
from hetseq.update.stats import RankReport, StatsSum


class Updates:
    """The job's updates as an exchange mode may touch them (the Controller
    behind a narrow door): the parameters, a step, the count and the rate."""

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

    def step(self, sample_size):
        """Scale the summed gradient by divisor/N, clip, check, step
        (controller.py's math); (whether a step was made, its norm)."""
        return self._controller.apply_update(sample_size)

    def update_as_rank_0(self, sample_size):
        """A rank that sits out: the update as rank 0 made it; whether made."""
        return self._controller.update_as_rank_0(sample_size)

    def count(self):
        """One more update that made no step but counts (the LR schedule moves)."""
        self._controller.count_update()

    @property
    def done(self):
        """Updates so far."""
        return self._controller.num_updates

    @property
    def lr(self):
        """The learning rate of the next update."""
        return self._controller.lr

    def mark(self):
        """Where the updates stand: the optimizer's state (a copy) and the count."""
        controller = self._controller
        return copy.deepcopy(controller.optimizer.state_dict()), controller.num_updates

    def back_to(self, mark):
        """Back to a ``mark``: its optimizer state, its count and that count's rate."""
        optimizer_state, updates = mark
        controller = self._controller
        controller.optimizer.load_state_dict(optimizer_state)
        controller.num_updates = updates
        controller.lr = controller.lr_scheduler.step_update(updates + 1)

    def replicated(self):
        """The tensors the --zero mode keeps a copy of on every rank."""
        controller = self._controller
        return controller.sharding.replicated_state(controller.params, controller.optimizer)


@section
class NoFlags(Section):
    """The section of a mode without flags of its own."""


class Exchange:
    """The base of every mode: the protocol the Controller calls, and what
    every mode does alike (this rank's report in each update's stats)."""
    Config: type[Section] = NoFlags        # its section of the job's ExchangeConfig (its flags)
    sits_out = False        # True: a rank may leave its exchange (update/members.py)
    updates_per_exchange = 1
    # True: the --zero mode it holds may split the state by memory
    # (--state-shares memory, update/uneven.py): it wraps the model as built.
    shares_by_memory = True

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
        self._ended = None             # when this rank's last update ended
        self._report = RankReport()    # what this rank sends with the update under way
        self._recorded = False         # record() called since the last update ended

    def comm_hook(self):
        """(state, hook) for DDP's gradient all-reduce, or None for its own."""
        return None

    def hold(self, build):
        """The sharding mode to train under; ``build(comm_hook)`` builds the
        job's --zero mode with that DDP hook."""
        self.sharding = build(self.comm_hook())
        return self.sharding

    def attach(self, updates):
        """``updates``: Updates, once the model is wrapped and the optimizer built."""
        self.updates = updates

    # ---- one update ----

    def begin(self, checksum, signal):
        """Before an update's first forward: the StatsSum its
        micro-batches add to, carrying this rank's report."""
        return StatsSum(self.ctx, self._reporting(checksum, signal))

    def finish(self, stats, seconds, boundary):
        """The update, once backward ran on every micro-batch: a StepResult,
        or None when the mode has none yet. ``seconds``: this rank's compute
        time; ``boundary``: the run needs one model after it (validates,
        saves or stops)."""
        raise NotImplementedError(f"exchange mode {type(self).__name__} has no finish")

    def sit(self, stats):
        """The update of a rank that sits out (only where ``sits_out``)."""
        raise NotImplementedError(f"exchange mode {type(self).__name__} cannot sit out")

    def record(self, seconds, samples):
        """This rank's figures of the update (or round) that just ended, sent
        with the next one: compute seconds, samples, wall seconds."""
        self._last = (seconds, samples, self._wall())
        self._recorded = True

    def ended(self, result):
        """``result`` (of ``finish`` or ``sit``), checked: an update that ended
        carries this rank's figures (``record``), which rebalancing reads."""
        if result is not None and not self._recorded:
            raise UserError(f"exchange mode '{self.registered_name}' ended an update without "
                            "self.record(seconds, samples): call it in finish (and sit) "
                            "before returning the StepResult, or the plan sees no speeds")
        self._recorded = self._recorded and result is None
        return result

    def _reporting(self, checksum, signal):
        """This rank's RankReport for what it sends next (kept for a round's end)."""
        self._report = RankReport(*self._last, checksum, signal)
        return self._report

    def _wall(self):
        """Wall seconds since this rank's last update (round) ended (0: the first)."""
        now, ended, self._ended = time.perf_counter(), self._ended, time.perf_counter()
        return now - ended if ended is not None else 0.0

    # ---- agreement and checkpoints ----

    def replicated(self):
        """The tensors every rank holds a copy of (agreement.py keeps them equal)."""
        return self.updates.replicated()

    def settle(self, local=False):
        """Before the state is read: the model of the last complete exchange.
        By default what is in flight lands (perhaps a collective); ``local``
        (an elastic snapshot, the group perhaps broken): no collective, an
        update begun and not completed on every rank is undone."""

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
