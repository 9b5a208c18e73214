"""What a run shows people: progress (a tqdm bar or log lines), running
averages, TensorBoard scalars and ``balance.jsonl``. All of it is this
node's choice (its LogConfig and SaveConfig) and none of it communicates:
what it shows was computed by every rank anyway."""

import contextlib
import logging
import os
import time

from hetseq.reporting.balance import BalanceLog, ValidLog
from hetseq.reporting.progress import Clock, Progress, format_ranks
from hetseq.reporting.tensorboard import TensorBoard
from hetseq.base.sections import Section, flag, section
from hetseq.checkpoints.state import ANYTHING, Fields, MapOf, Number, OfType

logger = logging.getLogger("hetseq.run")


class Reporter:
    def __init__(self, log, save, ctx, task):
        self.cfg, self.ctx, self.task = log, ctx, task
        self.meters = Meters()      # a checkpoint component (--reset-meters)
        self.tensorboard = TensorBoard(log.tensorboard_logdir, ctx.is_main)
        self.balance_log = BalanceLog(save.save_dir, ctx.is_main and not save.no_save)
        self.valid_log = ValidLog(save.save_dir, ctx.is_main and not save.no_save)
        self.progress, self.rate = None, RateMeter()
        # The time left follows the rate of the last two log intervals.
        self.clock = Clock(window=2 * max(1, log.log_interval))
        self.board = ctx.board          # rank 0's status for hetseq-status (None elsewhere)
        self.save_dir = None if save.no_save else save.save_dir

    def plan(self, planned, due=None, valid_samples=None, batch=None):
        """The run's planned updates (None: no end given), for 'update N/M' and the
        time left; ``due(update)``: the validations and saves still due (Clock),
        ``valid_samples`` of one validation, ``batch`` of one update."""
        self.clock.planned, self.clock.due = planned, due
        self.clock.valid_samples, self.clock.batch = valid_samples, batch

    @contextlib.contextmanager
    def validating(self, split, samples, update):
        """One validation on ``split``: its start and end lines, its time for the time left."""
        with self._timed("validation", update, "validating '%s' (%d samples)...", split, samples):
            yield

    def saving(self, update):
        """One save after ``update`` (none written under --no-save)."""
        return self._timed("saving", update, "saving a checkpoint of update %d...", update,
                           shown=self.save_dir is not None)

    @contextlib.contextmanager
    def _timed(self, kind, update, start, *args, shown=True):
        shown = shown and self.ctx.is_main
        if shown:
            logger.info(start, *args)
        began = time.perf_counter()
        yield
        took = time.perf_counter() - began
        self.clock.paused(kind, took, update)
        if shown:
            logger.info("%s in %.1f s", "validated" if kind == "validation" else "saved", took)

    def start_epoch(self, epoch, updates, resumed=False):
        """``resumed``: the epoch goes on from a checkpoint, and so do its
        running averages (unless --reset-meters left them out)."""
        self.progress = Progress(updates, f"epoch {epoch:03d}", self.ctx.is_main,
                                 not self.cfg.no_progress_bar, self.cfg.log_interval, self.clock)
        if not resumed:
            self.meters.reset()
        self.rate = RateMeter()

    def _shown(self, update):
        return self.tensorboard.logdir is not None or update % max(1, self.cfg.log_interval) == 0

    def update(self, result, update, wall_time, batch_sizes, steps=1):
        """One update's figures (``result``: the Controller's StepResult;
        ``steps``: the updates it covers, a round's inner steps)."""
        n = result.sample_size
        metrics = {**self.task.reduce_metrics(result.totals), "sample_size": n, "lr": result.lr}
        if self.balance_log.path is not None:
            self.balance_log.record(update, batch_sizes, n, wall_time, result.ranks.seconds,
                                    result.ranks.samples, loss=metrics.get("loss"), lr=result.lr)
        norm = result.grad_norm if self._shown(update) else None
        if norm is not None:
            metrics["grad_norm"] = norm
        self.meters.update({k: v for k, v in metrics.items() if k not in ("lr", "sample_size")},
                           weight=n)
        stats = {**metrics, "samples_per_s": n / wall_time if wall_time > 0 else 0.0}
        rank_rates = {f"rank{r}_samples_per_s": s / t for r, (s, t)
                      in enumerate(zip(result.ranks.samples, result.ranks.seconds)) if t > 0}
        if self.tensorboard.logdir is not None:
            self.tensorboard.log("train", {**stats, **rank_rates}, update)
        self.rate.update(n)
        ranks = format_ranks(result.ranks.samples, result.ranks.seconds, batch_sizes) \
            if self.progress.due(update, steps) and len(batch_sizes) > 1 else None
        self.progress.log(stats, update, steps, ranks)
        if self.board is not None and self.board.due():
            self.board.update(
                update=update, planned=self.clock.planned, left_s=self.clock.left(update),
                left=self.clock.left_text(update) if self.clock.planned else None,
                loss=metrics.get("loss"), samples_per_s=stats["samples_per_s"],
                ranks=self.board.ranks(batch_sizes, result.ranks.samples, result.ranks.seconds,
                                       wall_time))

    def saved(self, updates):
        """A checkpoint of ``updates`` was written (rank 0's checkpoint_last.pt)."""
        if self.board is not None and self.save_dir is not None:
            self.board.update(checkpoint={
                "path": os.path.abspath(os.path.join(self.save_dir, "checkpoint_last.pt")),
                "update": updates, "time": time.time()})

    def done(self, reason):
        logger.info("done: %s", reason)
        if self.board is not None:
            self.board.update(state=f"done: {reason}")

    def end_epoch(self, epoch, updates):
        self.progress.summary({"epoch": epoch, "updates": updates,
                               **{f"avg_{k}": v for k, v in self.meters.averages().items()},
                               "samples_per_s": self.rate.rate})

    def valid(self, split, epoch, metrics, update):
        if self.ctx.is_main:
            logger.info("valid on '%s' | epoch %03d | %s | update %d", split, epoch,
                        " | ".join(f"{k}={v:.4g}" for k, v in metrics.items()), update)
        self.tensorboard.log(f"valid_{split}", metrics, update)
        self.valid_log.record(update, epoch, split, metrics)

    def close(self):
        self.tensorboard.close()
        self.balance_log.close()
        self.valid_log.close()

    def how_to_look(self, save_dir):
        """The last lines of a run: where its picture and its TensorBoard are."""
        if not self.ctx.is_main:
            return
        if self.balance_log.path is not None:
            logger.info("picture of this run: hetseq-plot %s (writes %s)", save_dir,
                        os.path.join(save_dir, "run.png"))
        if self.tensorboard.logdir is not None:
            logger.info("TensorBoard: tensorboard --logdir %s", self.tensorboard.logdir)


@section
class LogConfig(Section):
    """What this node prints and writes for people to read."""
    no_progress_bar: bool = flag(False, action="store_true",
                                 help="plain log lines, no tqdm bar")
    log_interval: int = flag(1, type=int, metavar="N",
                             help="log every N updates when there is no progress bar "
                                  "(default: 1)")
    log_format: str = flag("tqdm", choices=["tqdm", "simple", "json", "none"],
                           help="'tqdm' shows a bar; any other value logs plain lines "
                                "(default: tqdm)")
    log_all_ranks: bool = flag(False, action="store_true",
                               help="log INFO on every rank, not only rank 0")
    tensorboard_logdir: str | None = flag(None, metavar="DIR",
                                          help="write TensorBoard scalars here (rank 0; default: "
                                               "<save-dir>/tensorboard, none with --no-save)")
    no_tensorboard: bool = flag(False, action="store_true",
                                help="write no TensorBoard scalars")

    @classmethod
    def from_args(cls, args, save_dir):
        # Any --log-format but tqdm means plain log lines. TensorBoard writes
        # into <save-dir>/tensorboard (``save_dir``: SaveConfig's) unless told
        # where, or not to (--no-save writes nothing into the save dir).
        logdir = args.tensorboard_logdir
        if logdir is None and not (args.no_tensorboard or args.no_save):
            logdir = os.path.join(save_dir, "tensorboard")
        return super().from_args(args, no_progress_bar=args.no_progress_bar
                                 or args.log_format != "tqdm",
                                 tensorboard_logdir=None if args.no_tensorboard else logdir)


# Running averages and rates for the training log (the meters: a checkpoint component).
class AverageMeter:
    """Weighted running average (e.g. loss weighted by sample count)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.sum = 0.0
        self.count = 0.0

    def update(self, value, weight=1.0):
        self.sum += value * weight
        self.count += weight

    @property
    def avg(self):
        return self.sum / self.count if self.count else 0.0

    def state_dict(self):
        return {"sum": self.sum, "count": self.count}

    def load_state_dict(self, state):
        self.sum, self.count = state["sum"], state["count"]


class RateMeter:
    """Items per second of wall time since the last reset."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.start = time.perf_counter()
        self.items = 0.0

    def update(self, items):
        self.items += items

    @property
    def rate(self):
        elapsed = time.perf_counter() - self.start
        return self.items / elapsed if elapsed > 0 else 0.0


class Meters:
    """A named set of AverageMeters, created on first use."""

    def __init__(self):
        self._meters = {}

    def update(self, values, weight=1.0):
        for name, value in values.items():
            self._meters.setdefault(name, AverageMeter()).update(value, weight)

    def averages(self):
        return {name: meter.avg for name, meter in self._meters.items()}

    def reset(self):
        self._meters.clear()

    def state_dict(self):
        return {name: meter.state_dict() for name, meter in self._meters.items()}

    @staticmethod
    def state_kind():
        """What saved meters must be (hetseq/checkpoints/state.py): named sums, any sign
        (a loss may be negative, inf or NaN), over a weight that is not negative."""
        return MapOf(OfType(str), Fields({"sum": Number(finite=False),
                                          "count": Number(low=0)}, extra=ANYTHING))

    def load_state_dict(self, state):
        self._meters = {}
        for name, meter_state in state.items():
            self._meters[name] = AverageMeter()
            self._meters[name].load_state_dict(meter_state)
