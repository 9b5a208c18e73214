"""Local steps (``--local-steps H``): DiLoCo on machines of different speed.
Over a slow link an all-reduce of every gradient costs more than the
compute, so the ranks communicate once per round of H inner steps: each
steps its own optimizer on its mean sample loss, and the round ends with one
all-reduce of the changes weighted by samples and an outer step (the math is
beside ``end_round``; docs/slow-links.md, with --outer-overlap's)."""

import collections
import logging

import torch

from hetseq.distributed.collectives import gather_to_main
from hetseq.base.errors import UserError
from hetseq.base.sections import Section, flag, given_flags, section
from hetseq.checkpoints.state import ANYTHING, Count, Fields, ListOf, Optional
from hetseq.update.zero import held
from hetseq.update.modes.compress import CODECS
from hetseq.update.exchange import Exchange, refuse, register_exchange
from hetseq.update.modes.outer import DRAIN_S, LocalReplicas, OuterSum, first_line
from hetseq.checkpoints.keys import mode_key
from hetseq.update.stats import StatsSum, StepResult

logger = logging.getLogger(__name__)

# Its entries in the Controller's checkpoint: the outer step's state, every rank's inner optimizer.
ROUNDS = mode_key("local_steps", reset="optimizer")
OPTIMIZERS = mode_key("optimizers", reset="optimizer")


@section
class LocalStepsConfig(Section):
    local_steps: int = flag(0, type=int, metavar="H",
                            help="train H inner steps on each rank between exchanges (DiLoCo; "
                                 "docs/slow-links.md); default: every update synchronous, the "
                                 "large-batch update")
    outer_lr: float = flag(1.0, type=float, metavar="ETA",
                           help="--local-steps: rate of the outer step (default: %(default)s, "
                                "with --outer-momentum 0 the samples-weighted average of the "
                                "ranks' models; DiLoCo's: 0.7)")
    outer_momentum: float = flag(0.0, type=float, metavar="MU",
                                 help="--local-steps: Nesterov momentum of the outer step "
                                      "(default: %(default)s, none; DiLoCo's: 0.9, which "
                                      "multiplies the job's LR up to ETA / (1 - MU) times: "
                                      "docs/slow-links.md)")
    outer_overlap: bool = flag(False, action="store_true",
                               help="--local-steps: exchange a round while the next one "
                                    "computes; apply it one round late")
    outer_dtype: str = flag("float32", choices=sorted(CODECS.names()),
                            help="--local-steps: what the exchange sends; bfloat16 halves the "
                                 "bytes, int8 (with a scale per 256 values) quarters them "
                                 "(default: %(default)s)")


@register_exchange("local-steps")
class LocalSteps(Exchange):
    """The rounds of one rank: what it did in the round so far, the outer
    optimizer and the exchange. ``cfg``: its LocalStepsConfig."""
    Config = LocalStepsConfig
    sits_out = False     # the outer exchange spans the world (a rank without
                         # samples still sends its zero change: controller._idle)
    shares_by_memory = False   # its outer step keeps the --zero mode's even shares
    inner_steps = True         # an update is a rank's own step; a round's end, the exchange

    def __init__(self, cfg, precision_cfg, ctx, rewindable=False):
        super().__init__(cfg, precision_cfg, ctx, rewindable)
        # An inner step sums nothing: the gradient is divided by this rank's
        # samples alone, the gradient of ITS mean loss (the math above).
        self.divisor = 1
        self.updates_per_exchange = cfg.local_steps
        self.steps = 0                 # inner steps of the round so far
        self.round = StatsSum(ctx, local=True)   # the round's stats so far
        self.anchor = None             # theta_0; with --outer-overlap: global
        # --outer-overlap: this rank's parameters at the round's start
        self.start = None
        self.pending = None            # --outer-overlap: the exchange in flight
        # rewindable: (inner optimizer state, updates) at the starts of the
        # last two rounds (--outer-overlap may have to train both again).
        self.starts = collections.deque(maxlen=2 if cfg.outer_overlap else 1)
        self.open = False              # a round begun whose exchange is not sent yet
        self.sum = OuterSum(cfg.outer_dtype, ctx, cfg.outer_overlap)

    # ---- its flags (LocalStepsConfig's fields) ----

    @classmethod
    def asks(cls, args):
        return f"--local-steps {args.local_steps}" if args.local_steps else None

    @classmethod
    def check_args(cls, args, defaults, chosen):
        if args.local_steps < 0:
            raise UserError(f"--local-steps {args.local_steps}: expected H >= 1 inner steps per "
                            "round (or leave it out for synchronous updates)")
        if not chosen:
            given = given_flags(args, defaults, ("outer_lr", "outer_momentum", "outer_overlap",
                                                 "outer_dtype"))
            if given:
                raise UserError(f"{', '.join(given)} set the outer step of --local-steps; add "
                                "--local-steps H (e.g. 32)")
            return
        if not args.local_steps:
            raise UserError("--exchange local-steps: add --local-steps H, the inner steps of "
                            "a round (e.g. 32)")
        refuse(f"--local-steps {args.local_steps}", (
            (args.grad_compression != "none", "--grad-compression compresses synchronous "
             "updates; with --local-steps use --outer-dtype bfloat16 or int8"),
            (args.zero >= 2, f"--zero {args.zero} shards gradients or parameters, which local "
             "steps keep whole on every rank; use --zero 0, or --zero 1 (the outer step's "
             "state sharded)"),
            (args.fp16, "--fp16's loss scale would differ from rank to rank inside a round; "
             "use --bf16"),
            (args.reduce_dtype != "float32", f"--reduce-dtype {args.reduce_dtype} sets the "
             "dtype of gradient all-reduces, which local steps do not make; use --outer-dtype"),
            (args.outer_lr <= 0, f"--outer-lr {args.outer_lr}: expected a rate > 0"),
            (not 0 <= args.outer_momentum < 1, f"--outer-momentum {args.outer_momentum}: "
             "expected 0 <= mu < 1"),
        ))

    # ---- building ----

    def train_under(self, zero):
        self.outer_mode = zero             # built without a hook: no gradient all-reduce
        return LocalReplicas(zero, self.cfg)

    def attach(self, updates):
        super().attach(updates)
        cfg = self.cfg
        self.flat = FlatParams(updates.params)
        self.outer = self.outer_mode.build_optimizer(torch.optim.SGD(
            updates.params, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
            nesterov=cfg.outer_momentum > 0))

    # ---- inside a round ----

    def stats(self, report):
        """Before an inner step: the round's starting point, at its first step
        (rewindable: with a mark of the inner optimizer and the update count).
        ``report`` goes with the round's exchange; an inner step's stats stay here."""
        if self.steps == 0:
            self.open = True           # until its exchange is sent
            if self.rewindable:
                self.starts.append(self.updates.mark())
        if self.anchor is None:
            self.anchor = self.flat.read()
        if self.cfg.outer_overlap and self.start is None:
            self.start = self.flat.read()
        return StatsSum(self.ctx, local=True)

    def end(self, stats, made, norm, boundary):
        """After an inner step (the Controller stepped on this rank's own mean
        loss and counted it): at a round's end (H steps, or ``boundary``:
        the run needs one model after it), the exchange."""
        self.round.absorb(stats)
        self.steps += 1
        if not (boundary or self.steps >= self.cfg.local_steps):
            return None
        # The slots carry the previous round's figures, as they carry the previous update's.
        summed = StatsSum(self.ctx, self._report)
        summed.absorb(self.round)
        samples = float(self.round.own_samples())
        self.round, self.steps = StatsSum(self.ctx, local=True), 0
        totals, ranks = summed.result()
        everyone = totals["sample_size"]
        self.end_round(samples / everyone if everyone > 0 else 0.0, settle=boundary)
        return StepResult(totals, ranks, self.updates.lr, True)

    # ---- the end of a round ----

    @torch.no_grad()
    def end_round(self, weight, settle):
        """The end of a round, ``weight`` = S_r / S; ``settle``: every rank must
        hold the same model afterwards (the run validates, saves or stops)."""
        # theta_0: the round's start, the same on every rank; S_r: rank r's
        # samples in the round, S = sum_r S_r. D_r = theta_0 - theta_r and
        #     D = sum_r (S_r / S) D_r                 (one all-reduce)
        #     m = mu m + D,  theta = theta_0 - eta (D + mu m)   (the outer step)
        # With H = 1, eta = 1, mu = 0 and SGD inside, D_r = lr g_r / n_r and
        # theta = theta_0 - lr G / N: the synchronous update. --outer-overlap
        # sends d_r = start - theta_r in the background, applies the previous
        # round's D on ``global`` and trains on ``global - d_r`` meanwhile.
        current = self.flat.read()
        if not self.cfg.outer_overlap:
            self._outer_step(self.anchor, self.sum(
                [(a - c).mul_(weight) for a, c in zip(self.anchor, current)]))
            self.anchor, self.open = None, False   # the next round starts where this one left
            return
        change = [s - c for s, c in zip(self.start, current)]
        self._apply_pending()       # a failure here: this round is still open, the last unapplied
        sent = [d * weight for d in change]
        self.pending = self.sum.later(sent)
        self.open = False           # sent: it lands, or not, with the next round
        self.flat.write([g - d for g, d in zip(self.anchor, change)])
        self.start = self.flat.read()
        if settle:
            self.settle()

    def settle(self, local=False):
        """Wait for the round in flight and apply it: every rank holds ``global``.
        ``local``: no collective; a round cut short goes back (``_rewind``:
        the mark of the inner optimizer and count to go back to, or None)."""
        if local:
            return self._rewind()
        if self.cfg.outer_overlap and self.pending is not None:
            self._apply_pending()
            self.flat.write(self.anchor)
            self.start = None
        return None

    def drain(self):
        """--outer-overlap: the round already sent completes on the members
        only if this rank's half of its all-reduce does, so a rank that stops
        on its own error waits for it (bounded by the job's collective
        timeout) before it exits. Not applied: this rank is leaving."""
        if self.pending is None:
            return
        try:
            self.pending.result(timeout=self.ctx.timeout_s or DRAIN_S)
        except Exception as err:     # a member gone too, or the timeout: nothing to keep
            logger.info("the round in flight did not complete before this rank stopped (%s)",
                        first_line(err))

    def _apply_pending(self):
        if self.pending is None:
            return
        delta, self.pending = self.pending.result(), None
        self._outer_step(self.anchor, delta)
        self.anchor = self.flat.read()

    def _outer_step(self, anchor, delta):
        """theta = theta_0 - eta (D + mu m): the outer optimizer's step from
        ``anchor`` with D as its gradient (DiLoCo's outer gradient)."""
        self.flat.write(anchor)
        self.flat.set_grads(delta)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    # ---- agreement and checkpoints ----

    def replicated(self):
        """What every rank holds the same of at a round's end: the model of the
        last outer step and the outer optimizer's state (unless --zero 1 shards it)."""
        model = self.anchor if self.cfg.outer_overlap and self.anchor is not None else \
            self.updates.params
        return self.outer_mode.replicated_state(model, self.outer)

    def _rewind(self):
        """Back to the last outer step (--elastic, whose rule is: a round
        either ends with its exchange on every member, or the next
        generation trains it again from its start, on the same batches
        split among the new members). The model goes back to theta_0, the
        inner optimizer and the update count to where the round began; the
        outer step's state changes only at a round's end, so it stands.
        Returns the mark the Controller goes back to (None: the state of now)."""
        target = None
        if self.cfg.outer_overlap:
            target = self._rewind_overlapped()
        elif self.anchor is not None:     # inside a round (None: at an outer step)
            self.flat.write(self.anchor)
            target = self.starts[-1]
            self.anchor = None
        self.round, self.steps = StatsSum(self.ctx, local=True), 0
        self.forget_round()
        self.open = False
        return target

    def _rewind_overlapped(self):
        """--outer-overlap: round R's exchange was sent at its end and is
        applied at the end of round R+1. Either it reached this rank: apply
        it, as a settle at the end of R would (the model is ``global`` with
        R in it), and train R+1 again from its start. Or it did not (the
        member was lost before it completed): back to ``global`` without R,
        and train R again too. A member that holds R offers one more round
        of updates, so the next generation continues from it (the newest
        state, generations.choose_source), as it would from a save at the
        end of R."""
        inside = self.open                 # False: R's exchange sent, R+1 not begun
        if self.pending is None and not inside:
            return None                    # settled: every rank holds ``global``
        now_start = self.starts[-1] if inside else None     # None: the state of now
        if self.pending is None or self._arrived():
            target = now_start
        else:       # a pending round R began before this one (inside: two starts are kept)
            target = self.starts[-2] if inside else self.starts[-1]
        self.pending = None
        self.flat.write(self.anchor)
        self.start = None
        return target

    def _arrived(self):
        """Whether the exchange in flight completed here (applied if so). A
        collective blocked on a lost member fails when the heartbeats cut
        its connections, at the latest after the group's timeout."""
        try:
            delta = self.pending.result()
        except Exception as err:     # the lost member's connection, or the group's timeout
            logger.info("the round in flight did not complete here (%s): trained again",
                        first_line(err))
            return False
        self._outer_step(self.anchor, delta)
        self.anchor = self.flat.read()
        return True

    def state_dict(self, optimizer_state, local=False):
        """A save ends the round (settled). "local_steps": the outer step's state
        (a collective under --zero 1: consolidated on rank 0); "optimizers":
        every rank's own inner optimizer state, gathered on rank 0. ``local``
        (a snapshot): none of the others' (a new generation's ranks all
        continue from the source rank's own)."""
        if not local:
            self.settle()
        outer = self.outer_mode.optimizer_state(self.updates.model, self.outer)
        rounds = {ROUNDS: {"outer_optimizer": outer, "local_steps": self.cfg.local_steps}}
        return rounds if local else {**rounds,
                                     OPTIMIZERS: gather_to_main(optimizer_state, self.ctx)}

    def state_kind(self, optimizer):
        # The outer optimizer is over the same parameters as the inner one.
        outer = held.optimizer_kind(self.outer, optimizer.params)
        return {ROUNDS: Fields(optional={"outer_optimizer": Optional(outer),
                                         "local_steps": Count(1)}, extra=ANYTHING),
                OPTIMIZERS: ListOf(optimizer)}

    def load_state_dict(self, state):
        saved = state.get(ROUNDS) or {}
        if saved.get("outer_optimizer") is not None:
            self._tell_changed_outer_step(saved["outer_optimizer"])
            self.outer_mode.load_optimizer_state(self.updates.model, self.outer,
                                                 saved["outer_optimizer"])
            # The outer rate is this run's flag, not the saved one.
            for group in self.outer.param_groups:
                group.update(lr=self.cfg.outer_lr, momentum=self.cfg.outer_momentum,
                             nesterov=self.cfg.outer_momentum > 0)
        self.anchor = self.start = self.pending = None

    def _tell_changed_outer_step(self, saved):
        """A checkpoint whose outer step differs from this run's flags (one of
        a release whose default was DiLoCo's 0.7 / 0.9, for instance): the
        flags win, and the user is told how to keep the saved one."""
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not groups:
            return
        was = (groups[0].get("lr"), groups[0].get("momentum"))
        now = (self.cfg.outer_lr, self.cfg.outer_momentum)
        if None not in was and was != now and self.ctx.is_main:
            logger.warning("the checkpoint's outer step was --outer-lr %g --outer-momentum %g; "
                           "this run uses --outer-lr %g --outer-momentum %g (pass the saved "
                           "values to keep them)", *was, *now)

    def resumed_optimizer(self, state, saved):
        """This rank's own inner optimizer state when every rank's was saved
        for as many ranks, else the (one) saved state."""
        by_rank = state.get(OPTIMIZERS)
        if by_rank and len(by_rank) == self.ctx.world_size:
            return by_rank[self.ctx.rank]
        return saved


# Parameters as one flat copy per dtype and device: what --local-steps
# reads, averages and writes back in one piece per group, instead of one
# tensor per parameter.
class FlatParams:
    """The parameters as one flat copy per dtype and device."""

    def __init__(self, params):
        groups = {}
        for p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self.groups = list(groups.values())

    @torch.no_grad()
    def read(self):
        return [torch.cat([p.detach().reshape(-1) for p in group]) for group in self.groups]

    @torch.no_grad()
    def write(self, flats):
        for group, flat in zip(self.groups, flats):
            for p, part in zip(group, self._views(group, flat)):
                p.copy_(part)

    def set_grads(self, flats):
        for group, flat in zip(self.groups, flats):
            for p, part in zip(group, self._views(group, flat)):
                p.grad = part

    @staticmethod
    def _views(group, flat):
        offset = 0
        for p in group:
            yield flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
