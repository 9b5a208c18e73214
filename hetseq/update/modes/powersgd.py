"""--grad-compression powersgd: the synchronous update with DDP's all-reduce
compressed by PyTorch's PowerSGD, with error feedback (update/modes/compress.py).
The Controller's math is unchanged: the hook compresses the sum-loss
gradients, whose average is G/W."""

from hetseq.base.errors import UserError
from hetseq.base.sections import Section, flag, given_flags, section
from hetseq.update.modes.compress import powersgd_hook
from hetseq.update.exchange import refuse, register_exchange
from hetseq.update.modes.synchronous import Synchronous


@section
class PowerSGDConfig(Section):
    grad_compression: str = flag("none", choices=("none", "powersgd"),
                                 help="synchronous updates: compress the gradient all-reduce "
                                      "with PowerSGD (error feedback; --zero 0 or 1) "
                                      "(default: none)")
    powersgd_rank: int = flag(4, type=int, metavar="R",
                              help="PowerSGD: rank of each matrix's approximation (default: 4)")
    powersgd_start: int = flag(10, type=int, metavar="N",
                               help="PowerSGD: plain all-reduce for the first N updates (at "
                                    "least 2; default: 10)")
    powersgd_min_compression: float = flag(2.0, type=float, metavar="X",
                                           help="PowerSGD: compress a matrix only when that "
                                                "shrinks it X times; others go whole (default: "
                                                "2, PyTorch's)")


@register_exchange("powersgd")
class PowerSGD(Synchronous):
    """Its error memory lives in DDP's hook and starts empty in each process:
    a resumed or restarted run begins with --powersgd-start plain updates again."""
    Config = PowerSGDConfig
    sits_out = False     # the hook's state sums over the world

    def comm_hook(self):
        return powersgd_hook(self.cfg)

    @classmethod
    def asks(cls, args):
        return "--grad-compression powersgd" if args.grad_compression == "powersgd" else None

    @classmethod
    def check_args(cls, args, defaults, chosen):
        if not chosen:
            given = given_flags(args, defaults, ("powersgd_rank", "powersgd_start",
                                                 "powersgd_min_compression"))
            if given:
                raise UserError(f"{', '.join(given)} set PowerSGD; add --grad-compression "
                                "powersgd")
            return
        if args.grad_compression != "powersgd":
            # One spelling of the job: nodes compare --grad-compression too.
            raise UserError(f"--exchange powersgd compresses with --grad-compression powersgd, "
                            f"not --grad-compression {args.grad_compression}: give "
                            "--grad-compression powersgd (the --exchange may then go)")
        refuse("--grad-compression powersgd", (
            (args.zero >= 2, f"--zero {args.zero} reduce-scatters gradients (FSDP), which "
             "PowerSGD does not compress; use --zero 0 or 1"),
            (args.reduce_dtype != "float32", f"--reduce-dtype {args.reduce_dtype} is another "
             "compression of the same all-reduce; pick one"),
            (args.elastic, "--elastic restarts DDP with every change of members, and with it "
             "PowerSGD's error memory; leave out one of the two"),
            (args.powersgd_rank < 1, f"--powersgd-rank {args.powersgd_rank}: expected R >= 1"),
            (args.powersgd_start < 2, f"--powersgd-start {args.powersgd_start}: expected N >= 2 "
             "(DDP builds its buckets in the first update)"),
        ))
