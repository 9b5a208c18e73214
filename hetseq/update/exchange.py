"""Exchange modes: how the ranks' gradients become the job's update.

The Controller runs forward and backward on a rank's micro-batches; what it
then does with the gradients is its Exchange's, chosen once from the job's
ExchangeConfig (config.py), so every rank has the same one:

    synchronous  every update: the gradients are summed over ranks inside the
                 --zero mode's wrapper (DDP's all-reduce, in --reduce-dtype;
                 FSDP's reduce-scatter) and arrive divided by W; the
                 Controller scales them by W/N (controller.py)
    powersgd     the same, DDP's all-reduce compressed by PowerSGD with error
                 feedback (--grad-compression, distributed/compress.py)
    local-steps  H inner steps on each rank's own gradients, then one exchange
                 of the ranks' changes weighted by samples (local_steps.py)

The interface, in the order a run calls it (a new mode implements these,
registers itself in EXCHANGES and names itself in ``mode_of``):

    hold(mode)             the --zero mode to train under, built with
                           ``comm_hook()`` as its DDP hook
    attach(params)         the trainable parameters, once the model is wrapped
    begin()                before an update's first forward
    stats(checksum, signal)  the StatsExchange its micro-batches add to
    finish(stats, seconds, controller, boundary)
                           the update: a StepResult, or None inside a round
    divisor                what the summed gradient arrives divided by
    replicated(...)        the tensors every rank must hold equal
    drain()                this rank stops on its own error: what it sent completes
    settle(), state_dict(...), load_state_dict(...), resumed_optimizer(...)
                           its part of the Controller's checkpoint (its keys
                           declared with controller.CONTROLLER.key)
"""

import importlib
import time

from hetseq.config import given_flags
from hetseq.distributed.compress import CODECS
from hetseq.errors import UserError
from hetseq.registry import Registry
from hetseq.update import precision
from hetseq.update.stats import RankReport, StatsExchange, StepResult


class Exchange:
    """Synchronous updates: the gradient collectives run inside the --zero
    mode's backward, the stats in their own all-reduce (stats.py)."""
    # A rank may sit out (update/members.py): its gradient collectives run
    # in the members' group, and nothing else of the mode spans the world.
    sits_out = True

    def __init__(self, cfg, precision_cfg, ctx, rewindable=False):
        self.cfg, self.precision, self.ctx = cfg, precision_cfg, ctx
        # --elastic: a snapshot may have to go back to the last state every
        # rank completed (``rewind``), so the exchange keeps what it needs.
        self.rewindable = rewindable
        # Every --zero mode averages over the world (controller.py's math).
        self.divisor = ctx.world_size if ctx.distributed else 1
        self._last = (0.0, 0.0, 0.0)   # this rank's compute seconds, samples, wall, last update
        self._ended = None             # when this rank's last update ended
        self._report = RankReport()    # what this rank sends with the update under way

    # ---- building ----

    def comm_hook(self):
        """(state, hook) for DDP's gradient all-reduce, or None for its own."""
        hook = precision.ddp_comm_hook(self.precision)
        return (None, hook) if hook is not None else None

    def hold(self, mode):
        """The sharding mode to train under, given the job's --zero mode."""
        return mode

    def attach(self, params):
        """The trainable parameters (after wrapping; the optimizer is built)."""

    # ---- one update ----

    def begin(self, controller):
        """Before the update's first forward."""

    def rewind(self, controller):
        """Back to the last update every rank completed, with no collective
        (an elastic member's snapshot, the process group perhaps broken). A
        synchronous update is complete on this rank or not begun: nothing to
        undo."""

    def stats(self, checksum, signal):
        """The stats of the update about to run, with this rank's report."""
        return StatsExchange(self.ctx, self._reporting(checksum, signal))

    def _reporting(self, checksum, signal):
        """This rank's RankReport for what it sends next (kept for a round's end)."""
        self._report = RankReport(*self._last, checksum, signal)
        return self._report

    def finish(self, stats, seconds, controller, boundary):
        """The gradients are summed (inside backward): the Controller scales,
        clips and steps. ``seconds``: this rank's compute time of the update."""
        totals, ranks = stats.result()
        updated, norm = controller.apply_update(totals["sample_size"])
        self._last = (seconds, stats.own_samples(), self._wall())
        return StepResult(totals, ranks, controller.lr, updated, norm)

    def _wall(self):
        """Wall seconds since this rank's last update (round) ended (0: the first)."""
        now, ended, self._ended = time.perf_counter(), self._ended, time.perf_counter()
        return now - ended if ended is not None else 0.0

    def sit(self, stats, controller):
        """The update of a rank that sits out: its zeros in the stats, the
        update as rank 0 made it (``Controller.follow``)."""
        totals, ranks = stats.result()
        updated = controller.follow(totals["sample_size"])
        self._last = (0.0, 0.0, self._wall())
        return StepResult(totals, ranks, controller.lr, updated, None)

    # ---- agreement and checkpoints ----

    def replicated(self, mode, params, optimizer):
        """The tensors every rank holds a copy of (agreement.py keeps them equal)."""
        return mode.replicated_state(params, optimizer)

    def settle(self):
        """Every rank holds the same model after this (nothing in flight)."""

    def drain(self):
        """This rank stops on an error of its own (its data, its disk): what
        it already sent completes first, with no new collective, so the
        members keep it. A synchronous update has nothing in flight."""

    def state_dict(self, model, optimizer_state, local=False):
        """Its entries in the Controller's state (a collective where it says
        so, unless ``local``: this rank's own view, for a snapshot)."""
        return {}

    def load_state_dict(self, model, state):
        """From the Controller's saved state (entries a reset left out are absent)."""

    def resumed_optimizer(self, state, saved):
        """The optimizer state this rank loads, from the Controller's
        ``state``; ``saved``: its (one) saved optimizer state."""
        return saved


EXCHANGES = Registry("exchange mode", base=Exchange)
EXCHANGES.register("synchronous")(Exchange)


@EXCHANGES.register("powersgd")
class PowerSGD(Exchange):
    """Synchronous, with DDP's all-reduce compressed. Its error memory lives
    in DDP's hook and starts empty in each process: a resumed or restarted
    run begins with --powersgd-start plain updates again."""
    sits_out = False     # the hook's state sums over the world

    def comm_hook(self):
        from hetseq.distributed.compress import powersgd_hook
        return powersgd_hook(self.cfg)


def mode_of(cfg):
    """The exchange mode the job's ExchangeConfig asks for."""
    if cfg.local_steps:
        return "local-steps"
    return "powersgd" if cfg.grad_compression == "powersgd" else "synchronous"


def build(cfg, precision_cfg, ctx, rewindable=False):
    """This run's Exchange (``cfg``: the job's ExchangeConfig; ``rewindable``:
    --elastic, whose snapshots go back to the last completed update)."""
    importlib.import_module("hetseq.update.local_steps")   # registers "local-steps" (built on this)
    return EXCHANGES.get(mode_of(cfg))(cfg, precision_cfg, ctx, rewindable)


# ---- the flags of the exchange modes, and the combinations refused ----

def add_args(group):
    group.add_argument("--local-steps", type=int, default=0, metavar="H",
                       help="train H inner steps on each rank between exchanges (DiLoCo; "
                            "docs/slow-links.md); default: every update synchronous, "
                            "the large-batch update")
    group.add_argument("--outer-lr", type=float, default=1.0, metavar="ETA",
                       help="--local-steps: rate of the outer step (default: %(default)s, with "
                            "--outer-momentum 0 the samples-weighted average of the ranks' "
                            "models; DiLoCo's: 0.7)")
    group.add_argument("--outer-momentum", type=float, default=0.0, metavar="MU",
                       help="--local-steps: Nesterov momentum of the outer step (default: "
                            "%(default)s, none; DiLoCo's: 0.9, which multiplies the job's LR "
                            "up to ETA / (1 - MU) times: docs/slow-links.md)")
    group.add_argument("--outer-overlap", action="store_true",
                       help="--local-steps: exchange a round while the next one computes; "
                            "apply it one round late")
    group.add_argument("--outer-dtype", choices=sorted(CODECS.names()), default="float32",
                       help="--local-steps: what the exchange sends; bfloat16 halves the "
                            "bytes, int8 (with a scale per 256 values) quarters them "
                            "(default: %(default)s)")
    group.add_argument("--grad-compression", choices=("none", "powersgd"), default="none",
                       help="synchronous updates: compress the gradient all-reduce with "
                            "PowerSGD (error feedback; --zero 0 or 1) (default: none)")
    group.add_argument("--powersgd-rank", type=int, default=4, metavar="R",
                       help="PowerSGD: rank of each matrix's approximation (default: 4)")
    group.add_argument("--powersgd-start", type=int, default=10, metavar="N",
                       help="PowerSGD: plain all-reduce for the first N updates (at least "
                            "2; default: 10)")
    group.add_argument("--powersgd-min-compression", type=float, default=2.0, metavar="X",
                       help="PowerSGD: compress a matrix only when that shrinks it X times; "
                            "others go whole (default: 2, PyTorch's)")


def check_args(args, defaults):
    """Combinations that make no sense, each refused with one message
    (``defaults``: the parser's, to tell which flags were given)."""
    if args.local_steps < 0:
        raise UserError(f"--local-steps {args.local_steps}: expected H >= 1 inner steps per "
                        "round (or leave it out for synchronous updates)")
    if not args.local_steps:
        given = given_flags(args, defaults, ("outer_lr", "outer_momentum", "outer_overlap",
                                        "outer_dtype"))
        if given:
            raise UserError(f"{', '.join(given)} set the outer step of --local-steps; add "
                            "--local-steps H (e.g. 32)")
    else:
        _check_local_steps(args)
    _check_powersgd(args, defaults)



def _check_local_steps(args):
    refused = (
        (args.grad_compression != "none", "--grad-compression compresses synchronous updates; "
         "with --local-steps use --outer-dtype bfloat16 or int8"),
        (args.zero >= 2, f"--zero {args.zero} shards gradients or parameters, which local "
         "steps keep whole on every rank; use --zero 0, or --zero 1 (the outer step's state "
         "sharded)"),
        (args.fp16, "--fp16's loss scale would differ from rank to rank inside a round; use "
         "--bf16"),
        (args.reduce_dtype != "float32", f"--reduce-dtype {args.reduce_dtype} sets the dtype "
         "of gradient all-reduces, which local steps do not make; use --outer-dtype"),
        (args.outer_lr <= 0, f"--outer-lr {args.outer_lr}: expected a rate > 0"),
        (not 0 <= args.outer_momentum < 1, f"--outer-momentum {args.outer_momentum}: "
         "expected 0 <= mu < 1"),
    )
    _refuse(f"--local-steps {args.local_steps}", refused)


def _refuse(prefix, refused):
    """The first (bad, message) that is bad, as one UserError."""
    for bad, message in refused:
        if bad:
            raise UserError(f"{prefix}: {message}")


def _check_powersgd(args, defaults):
    if args.grad_compression != "powersgd":
        given = given_flags(args, defaults, ("powersgd_rank", "powersgd_start",
                                        "powersgd_min_compression"))
        if given:
            raise UserError(f"{', '.join(given)} set PowerSGD; add --grad-compression powersgd")
        return
    refused = (
        (args.zero >= 2, f"--zero {args.zero} reduce-scatters gradients (FSDP), which "
         "PowerSGD does not compress; use --zero 0 or 1"),
        (args.reduce_dtype != "float32", f"--reduce-dtype {args.reduce_dtype} is another "
         "compression of the same all-reduce; pick one"),
        (args.elastic, "--elastic restarts DDP with every change of members, and with it "
         "PowerSGD's error memory; leave out one of the two"),
        (args.powersgd_rank < 1, f"--powersgd-rank {args.powersgd_rank}: expected R >= 1"),
        (args.powersgd_start < 2, f"--powersgd-start {args.powersgd_start}: expected N >= 2 "
         "(DDP builds its buckets in the first update)"),
    )
    _refuse("--grad-compression powersgd", refused)
