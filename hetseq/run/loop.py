"""One rank's training run: the loop over epochs and updates (hetseq/app/main.py
starts the ranks).

One update, as ``Run.train_epoch`` drives it (docs/design.md, "One update",
follows its route through the code): the iterator yields this rank's
micro-batches of the next global batch(es); ``Controller.train_step`` makes
the update; then ``Run.after_update``, the one place of the bookkeeping,
checks the ranks' agreement, re-plans the split if a rank's speed changed,
tells the seam, reports, and says what follows (validate, save, stop).
"""

import itertools
import logging
import signal
import time

from hetseq.keyed import randomness
from hetseq.distributed import broadcast_from_main
from hetseq.run.seam import FIXED
from hetseq.base import stopping
from hetseq.base.errors import HetSeqError, UserError
from hetseq.base.logs import disk_of, why_not_written, write_failed
from hetseq.optim.lr_scheduler import planned_updates
from hetseq.plan import capacity, rebalance, startup
from hetseq.plan import links as exchange_links
from hetseq.reporting.report import Reporter
from hetseq.run import checkpoint
from hetseq.run.checkpoint import Component
from hetseq.run.events import Events
from hetseq.run.shares import StateSharing, held_bytes
from hetseq.run.validation import Validation
from hetseq.tasks import TASKS, Task, import_builtin_tasks, import_user_dir
from hetseq.update import precision
from hetseq.update.agreement import Agreement
from hetseq.checkpoints.keys import CONTROLLER, MODEL
from hetseq.update.controller import Controller
from hetseq.data.iterators import GlobalBatches, GlobalBatchIterator
from hetseq.distributed.collectives import all_gather_object

logger = logging.getLogger("hetseq.run")

# The run's parts of a checkpoint beside the Controller's (checkpoints/keys.py's CONTROLLER).
TRAIN_ITERATOR = Component("train_iterator", reset="dataloader")   # the data position
PLAN = Component("plan")                                             # the split of the batch
METERS = Component("meters", reset="meters")
FIRST_SAVE_S = 30.0    # what a stop allows for a save before one was timed


def train_worker(ctx, args, job, node, inputs=None):
    """Everything one rank does (``inputs``: what the task's resolve_inputs chose)."""
    import_builtin_tasks()
    import_user_dir(node.user_dir)   # a spawned process starts with an empty registry
    Run(args, job, node, ctx, inputs).train()


def build_task(args, inputs):
    task_cls = TASKS.get(args.task)
    # A task without resolve_inputs may keep a one-argument constructor.
    return task_cls(args) if inputs is None else task_cls(args, inputs)


class Run:
    """One rank's training run. ``args``: the flags (for the task); ``job``
    and ``node``: the JobConfig and NodeConfig (app/config.py); ``seam``: its
    one door to membership (run/seam.py: an elastic member's, or one
    that does nothing)."""

    def __init__(self, args, job, node, ctx, inputs=None, seam=FIXED):
        self.job, self.node, self.ctx = job, node, ctx
        self.seam = seam
        # The model's initial weights, the same on every rank. No draw made
        # while training comes from these generators (randomness.py keys them
        # by sample), so seeding them again each elastic generation changes none.
        randomness.seed_generators(job.training.seed)
        self.task = build_task(args, inputs)
        if job.checkpoint.export_hf and type(self.task).export_hf is Task.export_hf:
            raise UserError(f"--export-hf: task '{job.task}' cannot write a Hugging Face "
                            "folder (tasks that can: bert, glue)")
        model = self.task.build_model()
        self.sharing = StateSharing(job, node, ctx, model)
        self.controller = Controller(job, self.task, model, ctx,
                                     state_shares=self.sharing.fractions)
        self.splits = Splits(self.task, ctx, job.training.seed, node.num_workers, node.data)
        self.train_data, self.balance = self._plan_training()
        self.validation = Validation(self.task, self.controller, self.splits, ctx,
                                     node.shares.max_sentences_valid, self.balance)
        self.report = Reporter(node.log, node.save, ctx, self.task)
        self.agreement = Agreement(job.agreement, ctx, self.controller.replicated_state,
                                   self.controller.members)
        components = {CONTROLLER.name: self.controller, TRAIN_ITERATOR.name: self.train_data,
                      PLAN.name: self.balance, METERS.name: self.report.meters}
        # What a resume leaves out: the --reset-* flags' keys, and the split
        # of the batch where the seam re-plans (it was for other members).
        skip = Component.left_out(job.checkpoint) | ({PLAN.name} if seam.members_change else set())
        self.checkpointer = checkpoint.Checkpointer(
            job.checkpoint, node.save, ctx, components, skip=skip,
            flags=checkpoint.plain_args(args), entries=seam.entries())
        resumed = self.checkpointer.restore(seam.source)
        if resumed:
            logger.info("resumed from %s: epoch %d, %d updates done", resumed,
                        self.train_data.epoch, self.controller.num_updates)
        self.agreement.due(self.controller.num_updates, now=True)
        self.events = Events(job.training, job.checkpoint, job.schedule)
        self._epoch_end = None       # (epoch, its last update, updates per epoch): the time left
        self._plan_schedule()
        self._validated = None       # (update, metric) of the last validation
        self._stop = None            # (signal, rank): the stop the ranks agreed on
        seam.attach(self.controller, self.train_data, self._local_state)

    def _plan_training(self):
        """Every rank's share of the global batch (measured with --capacity
        auto, which also counts the exchange: plan/links.py), and this
        rank's iterator over the training split."""
        job, ctx, controller = self.job, self.ctx, self.controller
        dataset = self.splits.load(job.training.train_subset)
        plan, devices, links, held = startup.make_plan(
            job.capacity, self.node.shares, ctx, controller, dataset,
            self.task.collater(dataset), ctx.local_world_size,
            members_change=self.seam.members_change)
        if self.sharing.again(controller, plan, dataset, self.task.collater(dataset)):
            held = held_bytes(controller, ctx)
        per_update = controller.updates_per_exchange()
        if ctx.is_main:
            logger.info("capacity plan (%s), global batch %d, %s, %s:\n%s", job.capacity.capacity,
                        plan.global_batch, controller.describe_sharding(),
                        precision.describe(job.precision),
                        capacity.describe(plan, devices,
                                          list(zip(held, controller.state_shares()))))
            _log_exchange(plan, devices, links, per_update, controller.can_sit_out())
        auto = job.capacity.capacity == "auto"
        rebalancer = None if job.capacity.no_rebalance else rebalance.Rebalancer(
            plan, links, controller.can_sit_out(), per_update, advisory=not auto)
        lockstep = controller.lockstep
        data = self.splits.iterator(dataset, plan.batch_sizes, shuffle=True,
                                    micro_cap=plan.micro_caps[ctx.rank],
                                    min_micro_batches=plan.most_micro_batches() if lockstep else 1)
        return data, rebalance.Balance(plan, devices, data, ctx, lockstep, rebalancer,
                                       controller.set_members, controller.can_sit_out())

    def _plan_schedule(self):
        """Give the LR schedule the run's length when the flags leave it open."""
        planned = planned_updates(self.job.training, len(self.train_data.batches))
        if planned and not self.job.schedule.total_num_update:
            self.controller.set_horizon(planned)
        valid = None
        if planned and not self.job.training.disable_validation:
            # One validation's samples, for the time left before one is timed
            # (the splits are loaded now: a collective, every rank here).
            valid = sum(self.validation.size(split) for split in self.job.training.valid_subsets)
        self.report.plan(planned, self._still_due if planned else None, valid,
                         self.balance.plan.global_batch)
        if self.ctx.is_main:
            logger.info("LR schedule %s: %s; the run plans %s", self.job.schedule.lr_scheduler,
                        self.controller.lr_scheduler.describe(),
                        f"{planned} updates" if planned else
                        "no end (no --max-update or --max-epoch: stop it yourself)")

    def _still_due(self, update):
        """The validations and saves still due at ``update`` (the time left)."""
        if self._epoch_end is None:
            return {}
        return self.events.still_due(update, self.report.clock.planned, *self._epoch_end,
                                     saves=self.report.save_dir is not None)

    # ---- the loop ----

    def train(self):
        stopping.answer_from_thread()    # this process starts no rank from here on
        try:
            self._train()
        except HetSeqError:
            # This rank stops on an error of its own: what its exchange already
            # sent completes first, so the members keep that round.
            self.controller.exchange.drain()
            # The logs keep what they hold (the pending balance line, the
            # buffered TensorBoard events); a file the disk refuses says so
            # once (logs.BestEffort) and the error below stays the last line.
            self.report.close()
            raise

    def _train(self):
        while not self.stop_reason():
            epoch = self.train_data.epoch
            self.train_epoch(epoch)
            end_of_epoch = self.train_data.samples_in_epoch == 0
            if self._stop is not None:
                # Asked to stop (SIGINT, SIGTERM): keep this update, and go.
                self._save(epoch if end_of_epoch else None, None)
                break
            after = self.events.at_epoch_end(epoch if end_of_epoch else None,
                                             stopping=self.stop_reason() is not None)
            metric = self.validate(epoch) if after.validates else None
            if after.saves:
                self._save(epoch if end_of_epoch else None, metric)
        self.report.done(self.stop_reason())
        self.report.close()
        self.report.how_to_look(self.node.save.save_dir)
        if self._stop is not None:
            stopping.agreed(self._stop[0], self.controller.num_updates,
                            self.ctx.is_main and not self.node.save.no_save)
        elif self.job.checkpoint.export_hf:
            self.export()

    def _save(self, epoch, metric):
        per_update = self.report.clock.per_update(self.controller.num_updates)
        if per_update and not self.node.save.no_save:    # a stop asked now waits for it too
            self._expect_stop(self.controller.num_updates, per_update, self._save_s(per_update))
        with self.report.saving(self.controller.num_updates):
            self.checkpointer.save(self.controller.num_updates, self.train_data.epoch, epoch,
                                   metric)
        self.report.saved(self.controller.num_updates)
        self.seam.saved()

    def stop_reason(self):
        if self._stop is not None:
            signum, rank = self._stop
            return f"stopped by {signal.Signals(signum).name} (rank {rank}'s node)"
        return self.events.stop_reason(self.train_data.epoch, self.controller.num_updates,
                                       self.controller.lr)

    def train_epoch(self, epoch):
        training, controller, data = self.job.training, self.controller, self.train_data
        data.set_shuffle(epoch > training.curriculum)
        controller.set_epoch(epoch)
        update_freq = training.update_freq_at(epoch)
        left = -(-data.remaining_steps // update_freq)
        self._epoch_end = (epoch, controller.num_updates + left,
                           -(-len(data.batches) // update_freq))
        self.report.start_epoch(epoch, left, resumed=data.samples_in_epoch > 0)
        dummy = data.dummy_batch()
        started, steps = None, 0      # the update's (--local-steps: the round's) start
        for chunk in _chunks(data.next_epoch_itr(), update_freq):
            started, steps = started or time.perf_counter(), steps + 1
            joining = self.seam.begin_update()
            result = controller.train_step([micro for step in chunk for micro in step], dummy,
                                           checksum=self.agreement.pending, signal=joining,
                                           boundary=self._boundary(), stop=stopping.requested())
            if result is None:        # inside a round of --local-steps
                self.seam.raise_if_over()
                continue
            after = self.after_update(result, time.perf_counter() - started, steps)
            started, steps = None, 0
            if self._stop is not None or after.ends:
                break
            metric = self.validate(epoch) if after.validates else None
            if after.saves:
                self._save(None, metric)
            self.seam.raise_if_joining()
        self.report.end_epoch(epoch, controller.num_updates)

    def _boundary(self):
        """Whether the update just drawn ends its epoch or is followed by one
        of the run's events (events.py): --local-steps then ends the round,
        so that every rank holds one model. The same on every rank."""
        data = self.train_data
        return (data.samples_in_epoch in (0, data.dataset_size)
                or bool(self.events.after(self.controller.num_updates + 1)))

    def _local_state(self, position, controller_state):
        """This rank's state in the checkpoint format at data ``position``,
        with no collective (an elastic snapshot: the group may be broken)."""
        return self.checkpointer.local_state({TRAIN_ITERATOR.name: position,
                                              CONTROLLER.name: controller_state})

    def after_update(self, result, wall_time, steps=1):
        """The bookkeeping of every update, in one place after its step: the
        ranks kept equal, the split re-planned if a rank's speed changed, the
        seam told, the update reported (``steps``: the updates it covers, a
        round's inner steps). Returns what follows it (events.py)."""
        update = self.controller.num_updates
        self.agreement.check(result.ranks.checksum, update)
        self.agreement.due(update)
        plan = self.balance.plan      # the split this update ran with
        if self.ctx.distributed:      # one rank alone has nothing to balance
            self.balance.observe(update, result.ranks.seconds, result.ranks.samples,
                                 result.ranks.wall)
        self.seam.completed(result)   # after observe: a rank now left out keeps this update
        self.report.update(result, update, wall_time, plan.batch_sizes, steps)
        # A stop asked on any node (its signal in that rank's slot): every
        # rank reads the same slots, so every rank stops after this update.
        asked = [(int(signum), rank) for rank, signum in enumerate(result.ranks.stop) if signum]
        if asked:
            self._stop = asked[0]
        self._expect_stop(update, wall_time / max(steps, 1))
        return self.events.after(update)

    def _expect_stop(self, update, per_update, extra=0.0):
        """What a stop asked now would take (base/stopping.py): the rest of
        ``extra`` (a validation under way), an update (a round of
        --local-steps), a save; at the rate of the last updates."""
        clock = self.report.clock
        per_update = clock.per_update(update) or per_update
        exchange_s = per_update * self.controller.updates_per_exchange()
        stopping.expect(extra + exchange_s, self._save_s(per_update),
                        saves=not self.node.save.no_save)

    def _save_s(self, per_update):
        """What a save takes: the last one's time; before one, FIRST_SAVE_S
        at least (a model's first write may take far longer than an update)."""
        took = self.report.clock.took.get("saving")
        return took if took is not None else max(per_update, FIRST_SAVE_S)

    def validate(self, epoch):
        """Validate on every --valid-subset; returns the first one's
        --best-checkpoint-metric (None when the task does not report it).
        Once per update: an interval's validation that falls on an epoch's
        end or the stop is not made twice (the count is every rank's)."""
        updates = self.controller.num_updates
        if self._validated is not None and self._validated[0] == updates:
            return self._validated[1]
        best, clock = None, self.report.clock
        per_update = clock.per_update(updates)
        if per_update:
            self._expect_stop(updates, per_update, clock.expected("validation", per_update))
        for split in self.job.training.valid_subsets:
            with self.report.validating(split, self.validation.size(split), updates):
                metrics = self.validation.run(split)
                self.report.valid(split, epoch, metrics, updates)
            if best is None:
                best = metrics.get(self.job.checkpoint.best_checkpoint_metric)
        self._validated = (updates, best)
        if per_update:
            self._expect_stop(updates, per_update)
        return best

    def export(self):
        """--export-hf: the best checkpoint's model when there is one, else the last."""
        has_best = broadcast_from_main(self.checkpointer.has_best, self.ctx)
        # The full weights (a collective when they are sharded), into a plain copy.
        if has_best:
            best = self.checkpointer.best_state()     # on rank 0 only
            state = best[CONTROLLER.name][MODEL] if best is not None else None
        else:
            state = self.controller.full_model_state()
        if not self.ctx.is_main:
            return
        if has_best:
            logger.info("exporting the best checkpoint (%s %s)",
                        self.job.checkpoint.best_checkpoint_metric, self.checkpointer.best)
        model = self.task.build_model()
        model.load_state_dict(state)
        folder = self.job.checkpoint.export_hf
        try:
            self.task.export_hf(model, folder)
        except (OSError, RuntimeError) as err:
            if not write_failed(err):
                raise
            # The checkpoints are written: only the export is missing, and the
            # same command, which resumes at the run's end, makes it again.
            again = "(with --no-save it trains again)" if self.node.save.no_save else \
                f"(it resumes from {self.node.save.save_dir} at the end and exports)"
            raise UserError(f"--export-hf: cannot write {folder} ({why_not_written(err)}; "
                            f"{disk_of(folder)}). Free space or pass another --export-hf, "
                            f"then run the same command again {again}") from None


def _log_exchange(plan, devices, links, per_update, can_sit):
    """What the exchange costs on the measured links, who sits it out, or
    (where no rank can) whether each rank pays for its place."""
    if links is None:
        return
    members = [rank for rank in range(len(devices)) if rank not in plan.sitting]
    seconds = links.seconds(members)
    logger.info("links to rank 0: %s; one gradient exchange (%.1f MB) among the %d members: "
                "%.3f s%s", links.describe(), links.gradient_bytes / 1e6, len(members), seconds,
                f", {seconds / per_update:.4f} s per update over a round of {per_update}"
                if per_update > 1 else "")
    lines = exchange_links.why_sitting(plan, links, devices, per_update) if can_sit else \
        exchange_links.who_pays(plan.global_batch, plan.rates, plan.micro_caps, links, devices,
                                per_update)
    for line in lines:
        logger.info("%s", line)


def _chunks(iterable, size):
    """Consecutive lists of ``size`` items; the last may be shorter. Exhausts the input."""
    iterator = iter(iterable)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


# A task's splits as one rank reads them: loaded, checked, cut into global batches.
class Splits:
    """``task``'s datasets for this rank (``ctx``), with the run's ``seed``,
    this node's ``num_workers`` and its ``--data`` (named in errors)."""

    def __init__(self, task, ctx, seed, num_workers, data=None):
        self.task, self.ctx, self.seed = task, ctx, seed
        self.num_workers, self.data = num_workers, data

    def load(self, split):
        """The task's dataset for ``split``, checked to be the same size on every rank."""
        dataset = self.task.load_dataset(split)
        sizes = all_gather_object(len(dataset), self.ctx)
        if len(set(sizes)) > 1 or not sizes[0]:
            raise UserError(f"split '{split}' of --data {self.data} is empty or differs "
                            f"between ranks (sizes {sizes}); every node needs the same data")
        return dataset

    def iterator(self, dataset, shares, shuffle, micro_cap=0, min_micro_batches=1):
        """Global batches of ``dataset`` (B = sum of ``shares``), this rank's
        slice of each in micro-batches of at most ``micro_cap`` samples."""
        batches = GlobalBatches.for_dataset(dataset, sum(shares), self.seed, shuffle)
        return GlobalBatchIterator(dataset, self.task.collater(dataset), batches, shares,
                                   self.ctx.rank, self.num_workers, micro_cap, min_micro_batches,
                                   pin_memory=self.ctx.device.type == "cuda")
