"""Training entry point: parse flags, start this node's ranks, run the loop."""

import itertools
import logging
import math
import time

from hetseq import capacity, checkpoint, cli, rebalance
from hetseq.controller import Controller
from hetseq.data import GlobalBatches, GlobalBatchIterator
from hetseq.distributed import WorkerFailed, all_gather_object, broadcast_from_main, launch
from hetseq.distributed.identity import job_identity
from hetseq.distributed.launch import exit_now
from hetseq.errors import HetSeqError, UserError
from hetseq.logging import setup_logging
from hetseq.logging.balance import BalanceLog
from hetseq.logging.meters import Meters, RateMeter
from hetseq.logging.progress import Progress
from hetseq.logging.tensorboard import TensorBoard
from hetseq.stats import StatsExchange
from hetseq.optim.lr_scheduler import planned_updates
from hetseq.tasks import TASKS, Task, import_builtin_tasks, import_user_dir
from hetseq.utils import set_seed

logger = logging.getLogger("hetseq.train")


def main(argv=None):
    setup_logging(0)
    try:
        args = cli.parse_args(argv)
        task_cls = TASKS.get(args.task)
        inputs = task_cls.resolve_inputs(args)
        launch(args, train_worker, inputs, identity=job_identity(args, task_cls.per_node_flags))
    except (HetSeqError, WorkerFailed) as err:
        logger.error("%s", err)
        exit_now(err.exit_code)


def train_worker(args, ctx, inputs=None):
    """Everything one rank does (``inputs``: what the task's resolve_inputs chose)."""
    import_builtin_tasks()
    import_user_dir(args.user_dir)   # a spawned process starts with an empty registry
    Run(args, ctx, inputs).train()


class Run:
    """One rank's training run: task, model, controller, data and outputs."""

    def __init__(self, args, ctx, inputs=None):
        self.args, self.ctx = args, ctx
        set_seed(args.seed)
        task_cls = TASKS.get(args.task)
        # A task without resolve_inputs may keep a one-argument constructor.
        self.task = task_cls(args) if inputs is None else task_cls(args, inputs)
        if args.export_hf and type(self.task).export_hf is Task.export_hf:
            raise UserError(f"--export-hf: task '{args.task}' cannot write a Hugging Face "
                            "folder (tasks that can: bert, glue)")
        self.controller = Controller(args, self.task, self.task.build_model(), ctx)
        dataset = self.load(args.train_subset)
        self.plan, self.devices = capacity.make_plan(args, ctx, self.controller, dataset,
                                                     self.task.collater(dataset),
                                                     ctx.local_world_size)
        self.rebalancer = (rebalance.Rebalancer(self.plan)
                           if args.capacity == "auto" and not args.no_rebalance else None)
        self.train_data = self.make_iterator(dataset, self.plan.batch_sizes, shuffle=True)
        self.plan_schedule()
        self.valid_data = {}   # split -> iterator, built on first validation
        self.tensorboard = TensorBoard(args.tensorboard_logdir, ctx.is_main)
        self.balance_log = BalanceLog(args.save_dir, ctx.is_main and not args.no_save)
        self.meters = Meters()
        self.checkpointer = checkpoint.Checkpointer(args, ctx, self.components(), skip=(
            {"train_iterator"} if args.reset_dataloader else set()) | (
            {"meters"} if args.reset_meters else set()))
        resumed = self.checkpointer.restore()
        if resumed:
            logger.info("resumed from %s: epoch %d, %d updates done", resumed,
                        self.train_data.epoch, self.controller.num_updates)

    def plan_schedule(self):
        """Give the LR schedule the run's length when the flags leave it open."""
        planned = planned_updates(self.args, len(self.train_data.batches))
        if planned and not self.args.total_num_update:
            self.controller.set_horizon(planned)
        scheduler = self.controller.lr_scheduler
        if self.ctx.is_main and planned:
            logger.info("LR schedule %s: %d planned updates, warm-up %d", self.args.lr_scheduler,
                        planned, scheduler.warmup)

    # ---- state ----

    def components(self):
        """What a checkpoint holds, by name; the data position loads before the plan."""
        return {"controller": self.controller, "train_iterator": self.train_data,
                "plan": _PlanState(self), "meters": self.meters}

    def resume_plan(self, saved):
        """The saved split continues the run; a different world or batch starts afresh."""
        if not self.args.reset_dataloader:
            self._log_resume(saved)
        plan = self.plan
        if saved.global_batch == plan.global_batch and len(saved.batch_sizes) == self.ctx.world_size \
                and saved.batch_sizes != plan.batch_sizes:
            self.set_plan(saved, "the split saved in the checkpoint")

    def _log_resume(self, saved):
        """Say how the data continues when the global batch or the world changed:
        from the saved sample of the epoch (the position is kept in samples)."""
        data, plan = self.train_data, self.plan
        if self.ctx.is_main and (saved.global_batch != plan.global_batch
                                 or len(saved.batch_sizes) != len(plan.batch_sizes)):
            logger.info("resuming epoch %d at sample %d of %d with a global batch of %d on %d "
                        "ranks (saved: %d on %d ranks): the epoch goes on from that sample, "
                        "none repeated or skipped", data.epoch, data.samples_in_epoch,
                        data.batches.dataset_size, plan.global_batch, len(plan.batch_sizes),
                        saved.global_batch, len(saved.batch_sizes))

    def load(self, split):
        """The task's dataset for ``split``, checked to be the same size on every rank."""
        dataset = self.task.load_dataset(split)
        sizes = all_gather_object(len(dataset), self.ctx)
        if len(set(sizes)) > 1 or not sizes[0]:
            raise UserError(f"split '{split}' of --data {self.args.data} is empty or differs "
                            f"between ranks (sizes {sizes}); every node needs the same data")
        return dataset

    def make_iterator(self, dataset, shares, shuffle):
        """Global batches of ``dataset`` (B = sum of shares), this rank's share of each."""
        batches = GlobalBatches.for_dataset(dataset, sum(shares), self.args.seed, shuffle)
        return GlobalBatchIterator(dataset, self.task.collater(dataset), batches, shares,
                                   self.ctx.rank, self.args.num_workers,
                                   self.plan.micro_caps[self.ctx.rank],
                                   self.lockstep_micro_batches(shares))

    def lockstep_micro_batches(self, shares):
        """Micro-batches every rank runs per step when forwards communicate
        (FSDP): the most any rank needs; 1 (no padding) otherwise."""
        if not self.controller.lockstep:
            return 1
        caps = self.plan.micro_caps
        return max(-(-share // cap) if cap else 1 for share, cap in zip(shares, caps))

    def set_plan(self, plan, reason):
        old, self.plan = self.plan, plan
        self.train_data.set_shares(plan.batch_sizes)
        self.train_data.min_micro_batches = self.lockstep_micro_batches(plan.batch_sizes)
        if self.rebalancer is not None:
            self.rebalancer.plan = plan
        if self.ctx.is_main:
            logger.info("capacity plan changed at update %d: batches %s -> %s; %s",
                        self.controller.num_updates, "/".join(map(str, old.batch_sizes)),
                        "/".join(map(str, plan.batch_sizes)), reason)
            logger.debug("capacity plan:\n%s", capacity.describe(plan, self.devices))

    # ---- the loop ----

    def train(self):
        args = self.args
        while not self.stop_reason():
            epoch = self.train_data.epoch
            self.train_epoch(epoch)
            end_of_epoch = self.train_data.samples_in_epoch == 0
            stopping = self.stop_reason() is not None
            metric = None
            if not args.disable_validation and (
                    stopping or (end_of_epoch and epoch % args.validate_interval == 0)):
                metric = self.validate(epoch)
            if stopping or (end_of_epoch and epoch % args.save_interval == 0):
                self.checkpointer.save(self.controller.num_updates, self.train_data.epoch,
                                       epoch if end_of_epoch else None, metric)
        logger.info("done: %s", self.stop_reason())
        self.tensorboard.close()
        self.balance_log.close()
        if self.args.export_hf:
            self.export()

    def export(self):
        """--export-hf: the best checkpoint's model when there is one, else the last."""
        has_best = broadcast_from_main(self.checkpointer.has_best, self.ctx)
        # The full weights (a collective when they are sharded), into a plain copy.
        state = self.checkpointer.best_model_state() if has_best else \
            self.controller.sharding.model_state(self.controller.model)
        if not self.ctx.is_main:
            return
        if has_best:
            logger.info("exporting the best checkpoint (%s %s)", self.args.best_checkpoint_metric,
                        self.checkpointer.best)
        model = self.task.build_model()
        model.load_state_dict(state)
        self.task.export_hf(model, self.args.export_hf)

    def stop_reason(self):
        args, controller = self.args, self.controller
        if args.max_epoch and self.train_data.epoch > args.max_epoch:
            return f"reached --max-epoch {args.max_epoch}"
        if args.max_update and controller.num_updates >= args.max_update:
            return f"reached --max-update {args.max_update}"
        if controller.lr <= args.min_lr:
            return f"learning rate {controller.lr:.3g} reached --min-lr {args.min_lr:.3g}"
        return None

    def train_epoch(self, epoch):
        args, controller = self.args, self.controller
        self.train_data.batches.shuffle = epoch > args.curriculum
        controller.set_epoch(epoch)
        update_freq = args.update_freq[min(epoch, len(args.update_freq)) - 1]
        remaining = self.train_data.remaining_steps
        progress = Progress(math.ceil(remaining / update_freq), f"epoch {epoch:03d}",
                            self.ctx.is_main, not args.no_progress_bar, args.log_interval)
        self.meters.reset()
        rate = RateMeter()
        steps = self.train_data.next_epoch_itr()
        dummy = self.train_data.dummy_batch()
        for chunk in _chunks(steps, update_freq):
            start = time.perf_counter()
            # With --clip-norm 0 the grad norm is only measured when it is shown.
            shown = self.tensorboard.logdir is not None or \
                (controller.num_updates + 1) % args.log_interval == 0
            metrics = controller.train_step([micro for step in chunk for micro in step], dummy,
                                            grad_norm=shown)
            stats = self.update_stats(metrics, time.perf_counter() - start)
            rate.update(metrics["sample_size"])
            progress.log(stats, controller.num_updates)
            if args.max_update and controller.num_updates >= args.max_update:
                break
            if args.save_interval_updates and controller.num_updates % args.save_interval_updates == 0:
                self.checkpointer.save(controller.num_updates, self.train_data.epoch)
        progress.summary({"epoch": epoch, "updates": controller.num_updates,
                          **{f"avg_{k}": v for k, v in self.meters.averages().items()},
                          "samples_per_s": rate.rate})

    def update_stats(self, metrics, wall_time):
        rank_times, rank_samples = metrics.pop("rank_times"), metrics.pop("rank_samples")
        self.balance_log.record(self.controller.num_updates, self.plan.batch_sizes,
                                metrics["sample_size"], wall_time, rank_times, rank_samples)
        new_plan = self.rebalancer and self.rebalancer.observe(rank_times, rank_samples)
        if new_plan:
            self.set_plan(new_plan, self.rebalancer.reason)
        n = metrics["sample_size"]
        self.meters.update({k: v for k, v in metrics.items() if k not in ("lr", "sample_size")},
                           weight=n)
        stats = {**metrics, "samples_per_s": n / wall_time if wall_time > 0 else 0.0}
        rank_rates = {f"rank{r}_samples_per_s": s / t for r, (s, t)
                      in enumerate(zip(rank_samples, rank_times)) if t > 0}
        self.tensorboard.log("train", {**stats, **rank_rates}, self.controller.num_updates)
        return stats

    def validate(self, epoch):
        """Validate on every --valid-subset; returns the first one's
        --best-checkpoint-metric (None when the task does not report it)."""
        best = None
        for split in self.args.valid_subset.split(","):
            if split not in self.valid_data:
                sizes = all_gather_object(self.args.max_sentences_valid, self.ctx)
                shares = self.plan.batch_sizes if None in sizes else sizes
                self.valid_data[split] = self.make_iterator(self.load(split), shares, shuffle=False)
            data = self.valid_data[split]
            # Start with the task's keys at zero (a rank may get no samples at all)
            # so every rank all-reduces a vector of the same layout.
            stats = StatsExchange(self.ctx)
            self.controller.valid_step(data.dummy_batch(), stats)
            stats.clear()
            for step in data.next_epoch_itr():
                for sample in step:
                    if sample is not None:
                        self.controller.valid_step(sample, stats)
                    elif self.controller.lockstep:   # its forward communicates: pad
                        self.controller.valid_step(data.dummy_batch(), stats, weight=0.0)
            totals, _ = stats.result()
            metrics = self.task.reduce_metrics(totals)
            if self.ctx.is_main:
                logger.info("valid on '%s' | epoch %03d | %s", split, epoch,
                            " | ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            self.tensorboard.log(f"valid_{split}", metrics, self.controller.num_updates)
            if best is None:
                best = metrics.get(self.args.best_checkpoint_metric)
        return best


class _PlanState:
    """The capacity plan as a checkpoint component (see Run.resume_plan)."""

    def __init__(self, run):
        self.run = run

    def state_dict(self):
        return self.run.plan.state_dict()

    def load_state_dict(self, state):
        self.run.resume_plan(capacity.Plan.from_state_dict(state))


def _chunks(iterable, size):
    """Consecutive lists of ``size`` items; the last may be shorter. Exhausts the input."""
    iterator = iter(iterable)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


if __name__ == "__main__":
    main()
