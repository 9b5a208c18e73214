"""Checkpoints of a run: what they hold (components, their keys declared in
hetseq/checkpoints/state.py), when rank 0 saves, and how a run resumes. The files
themselves, written atomically and read safely, are checkpoints/files.py's.
Sharded state is gathered to rank 0 and saved in the one full format
(docs/design.md, 'Checkpoints', says why not torch.distributed.checkpoint).
"""

import logging
import os
import re
import zipfile

import torch

from hetseq.base.errors import UserError
from hetseq.checkpoints import files as files
from hetseq.run.rng_state import rng_kind, rng_state, set_rng_state
from hetseq.base.sections import Section, flag, section
from hetseq.checkpoints.state import (ANYTHING, Component, Count, Fields, ListOf, Number, OfType,
                                      Optional, StateMismatch, describe)
from hetseq.checkpoints.keys import CONTROLLER, UPDATES
from hetseq.tasks import TASKS

logger = logging.getLogger(__name__)

# The checkpoint's own entries: the run's flags for people to read, every
# rank's random generators, the best validation metric, the elastic lineage.
# Their kinds are what any reader relies on (fine-tuning reads the flags'
# paths, an elastic node the members' addresses); the RNG's is rng_state.py's.
_PATH = Optional(OfType(str))
Component("format", kind=OfType(str))
Component("args", kind=Fields(optional={"task": _PATH, "config_file": _PATH, "dict": _PATH},
                              extra=ANYTHING))
Component("best", kind=Optional(Number(finite=False)))    # a metric may be NaN
Component("elastic", kind=Fields(optional={
    "lineage": ListOf(OfType(str)),
    "members": ListOf(Fields({"addr": OfType(str), "port": Count(0, 65535)}, extra=ANYTHING))},
    extra=ANYTHING))
RNG = Component("rng", reset="dataloader").name


def _reset(part):
    return flag(False, action="store_true",
                help=f"on resume, do not load the {part.replace('-', ' ')} state")


@section
class CheckpointConfig(Section):
    """When a run saves, what it keeps and what a resume loads (the job's;
    where a node keeps its files is its SaveConfig, below)."""
    save_interval: int = flag(1, type=int, metavar="N", help="save every N epochs (default: 1)")
    save_interval_updates: int = flag(0, type=int, metavar="N",
                                      help="also save every N updates, mid-epoch (0: off)")
    keep_interval_updates: int = flag(-1, type=int, metavar="N",
                                      help="keep only the last N checkpoints of "
                                           "--save-interval-updates (-1: all; 0: none, only "
                                           "checkpoint_last.pt and _best)")
    keep_last_epochs: int = flag(-1, type=int, metavar="N",
                                 help="keep only the last N checkpoint<EPOCH>.pt (-1: all; 0: "
                                      "none, only checkpoint_last.pt and _best)")
    no_epoch_checkpoints: bool = flag(False, action="store_true",
                                      help="keep only checkpoint_last.pt (and _best), not "
                                           "checkpoint<EPOCH>.pt")
    best_checkpoint_metric: str = flag("loss", metavar="NAME",
                                       help="validation metric that picks checkpoint_best.pt "
                                            "(default: %(default)s)")
    maximize_best_checkpoint_metric: bool = flag(
        None, action="store_true",
        help="a larger --best-checkpoint-metric is better; without the flag, larger is "
             "better for every metric but a loss (accuracy, f1, ...)")
    export_hf: str | None = flag(None, metavar="DIR",
                                 help="at the end of training, write the model (the best "
                                      "checkpoint's when there is one) as a Hugging Face folder "
                                      "(tasks bert, glue)")
    # One per part of state.RESETS (Component.left_out reads them by name).
    reset_optimizer: bool = _reset("optimizer")
    reset_lr_scheduler: bool = _reset("lr-scheduler")
    reset_dataloader: bool = _reset("dataloader")
    reset_meters: bool = _reset("meters")

    @classmethod
    def from_args(cls, args):
        maximize = args.maximize_best_checkpoint_metric
        if maximize is None:     # as Hugging Face: larger is better but for a loss
            maximize = not args.best_checkpoint_metric.endswith("loss")
        return super().from_args(args, maximize_best_checkpoint_metric=maximize)


def plain_args(args):
    """The flags as plain data (what a checkpoint may hold)."""
    return {k: v for k, v in vars(args).items()
            if v is None or isinstance(v, (bool, int, float, str, list, tuple))}


def _updates_in(path):
    """The updates checkpoint ``path`` holds, its tensors left on the disk
    (mmap: the file may be large and the run is ending); None when it cannot
    be read. Only an archive of stored records, as torch.save writes, is
    read: torch.load would inflate a compressed one."""
    try:
        with zipfile.ZipFile(path) as archive:
            if any(r.compress_type != zipfile.ZIP_STORED for r in archive.infolist()):
                return None
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(state[CONTROLLER.name][UPDATES])
    except Exception:   # only for the message: an unreadable count is left out
        return None


def _misfit(err):
    """One line for why a state did not load. torch's load_state_dict error
    lists every missing and unexpected key on lines of their own: count them
    and name the first of each kind."""
    text = str(err)
    parts = []
    for label, pattern in (("missing", r"Missing key\(s\) in state_dict: (.*?)\.\s*$"),
                           ("unexpected", r"Unexpected key\(s\) in state_dict: (.*?)\.\s*$")):
        match = re.search(pattern, text, re.M)
        if match:
            keys = re.findall(r'"([^"]+)"', match.group(1))
            parts.append(f"{len(keys)} {label} key(s), e.g. {keys[0]}" if keys else label)
    shape = r"torch\.Size\(\[([^\]]*)\]\)"
    sizes = re.findall(rf"size mismatch for (\S+): copying a param with shape {shape} from "
                       rf"checkpoint, the shape in current model is {shape}", text)
    if sizes:
        name, saved, current = sizes[0]
        parts.append(f"{len(sizes)} tensor(s) of another shape, e.g. {name}: [{saved}] saved, "
                     f"[{current}] here")
    if parts:
        return "; ".join(parts)
    return f"{type(err).__name__}: {text.strip().splitlines()[0][:300] if text.strip() else ''}"


class Checkpointer:
    """When and what a run saves, and how it resumes: each named component's
    state (``state_dict()``/``load_state_dict()``, loaded in the order given)
    under its name; ``skip`` is what a resume leaves out (the --reset-*
    flags): a component ("meters") or one part of one ("controller.optimizer").
    ``cfg`` is the job's CheckpointConfig, ``save`` this node's SaveConfig
    (rank 0's decides where checkpoints go), ``flags`` the plain flags kept for
    people to read, ``entries`` plain entries kept as given (elastic/hooks.py).
    ``save`` is called on every rank; ``restore`` sends rank 0's copy to all.
    """

    def __init__(self, cfg, save, ctx, components, skip=(), flags=None, entries=None):
        self.cfg, self.where, self.ctx = cfg, save, ctx
        self.entries = dict(entries or {})
        self.components, self.skip = dict(components), frozenset(skip)
        self.flags = flags or {}
        self.best = None
        self._saved = None          # the updates of this run's last save (rank 0)
        if not save.no_save and ctx.is_main:
            files.check_save_dir(save.save_dir)
            files.remove_stale_temporaries(save.save_dir)

    def restore(self, source=None):
        """Load the state to resume from into the components; where it came
        from, or None when there is none (a fresh start). ``source``: (rank,
        make, check) when ``make()`` on that rank gives the state and
        ``check(state)`` says why every rank refuses it, or None (an elastic
        member's memory, which must be the one the round chose:
        elastic/hooks.py); by default rank 0 reads --restore-file."""
        from hetseq.distributed.collectives import broadcast_from
        path = files.restore_path(self.where)
        rank, make, check = source or (
            0, lambda: files.load(path) if os.path.exists(path) else None, None)
        where = path if source is None else f"the state of rank {rank}"
        state = broadcast_from(rank, make, self.ctx)
        if state is None:
            return None
        refusal = check(state) if check is not None else None
        if refusal:
            raise UserError(f"{where} {refusal}")
        self.check(state, where)
        try:
            for name, component in self.components.items():
                if name not in self.skip:
                    component.load_state_dict(self._kept(name, state[name]))
        except UserError as err:
            raise UserError(f"checkpoint {where}: {err}") from None
        except (RuntimeError, KeyError, ValueError) as err:
            raise UserError(f"checkpoint {where} does not fit this run ({_misfit(err)}); it was "
                            "made for another model or task: pass --restore-file for another "
                            "checkpoint, or a new --save-dir to start afresh") from None
        rng = state.get(RNG) or []
        if len(rng) == self.ctx.world_size and RNG not in self.skip:
            set_rng_state(rng[self.ctx.rank])
        self.best = state.get("best")
        return where

    def check(self, state, where=None):
        """Refuse ``state`` (a UserError naming the field, the same on every
        rank) unless every part this run loads is what it builds: each
        component's ``state_kind()`` (a Kind of hetseq/checkpoints/state.py; anything
        for a component without one), the kinds declared with the keys,
        and the RNG states. Before any part loads: a part of the wrong type,
        sign or shape would fail inside torch, mid-load or mid-step, and
        under a split state (--zero 1/2/3) on some ranks only."""
        try:
            if not isinstance(state, dict):
                raise StateMismatch("", describe(state), "a dict")
            Component.check_declared(state)
            for name, component in self.components.items():
                if name in self.skip:
                    continue
                if name not in state:
                    raise StateMismatch(name, "missing", "this run's part "
                                        f"'{name}' (a checkpoint of another task or program?)")
                kind = getattr(component, "state_kind", None)
                if not isinstance(state[name], dict):
                    raise StateMismatch(name, describe(state[name]), "a dict")
                if kind is not None:
                    kind().check(self._kept(name, state[name]), name)
            if RNG in state and RNG not in self.skip:
                rng_kind().check(state[RNG], RNG)
        except StateMismatch as err:
            named = "the checkpoint" if where is None else f"checkpoint {where}"
            raise UserError(f"{named} does not fit this run: {err}; pass --restore-file for "
                            "another checkpoint, or a new --save-dir to start afresh") from None
        except UserError as err:    # a kind's own words, with their fix (another optimizer)
            raise UserError(str(err) if where is None else f"checkpoint {where}: {err}") \
                from None

    def _kept(self, name, state):
        """A component's state without the parts ``skip`` leaves out."""
        left_out = {part.split(".", 1)[1] for part in self.skip if part.startswith(name + ".")}
        return {k: v for k, v in state.items() if k not in left_out} if left_out else state

    def save(self, updates, data_epoch, epoch=None, metric=None):
        """checkpoint_last.pt, plus checkpoint<EPOCH>.pt at the end of an epoch,
        checkpoint_<DATA_EPOCH>_<UPDATES>.pt mid-epoch, and checkpoint_best.pt
        when ``metric`` improved."""
        from hetseq.distributed import all_gather_object

        # Every rank, whatever its own --no-save (rank 0's decides): the RNG
        # states and sharded components are gathered to rank 0.
        rngs = all_gather_object(rng_state(), self.ctx)
        components = {name: component.state_dict() for name, component in self.components.items()}
        if self.where.no_save or not self.ctx.is_main:
            return
        improved = metric is not None and self._improves(metric)
        if improved:
            self.best = metric
        state = self._state(components, rngs)
        folder, cfg = self.where.save_dir, self.cfg
        last = os.path.join(folder, "checkpoint_last.pt")
        copies = []
        # A copy that would be pruned at once (--keep-* 0) is not written.
        if epoch is not None and not cfg.no_epoch_checkpoints and cfg.keep_last_epochs != 0:
            copies.append(f"checkpoint{epoch}.pt")
        elif epoch is None and cfg.save_interval_updates and cfg.keep_interval_updates != 0 \
                and updates % cfg.save_interval_updates == 0:
            copies.append(f"checkpoint_{data_epoch}_{updates}.pt")
        if improved:
            copies.append("checkpoint_best.pt")
        try:
            files.save(last, state)
            for name in copies:
                files.copy(last, os.path.join(folder, name))
        except files.SaveFailed as err:
            raise self._save_failed(err, last, updates) from None
        self._saved = updates
        files.prune(folder, r"checkpoint_(\d+)_(\d+)\.pt", cfg.keep_interval_updates)
        files.prune(folder, r"checkpoint(\d+)\.pt", cfg.keep_last_epochs)
        logger.info("saved %s (%d updates)%s", last, updates,
                    "".join(f", {name}" for name in copies))

    def _save_failed(self, err, last, updates):
        """The end of a run whose save the disk refused: one line naming the
        disk (err's) and the checkpoint that resumes it, with the fix."""
        last = os.path.abspath(last)
        if err.gone:
            resumes = "nothing resumes this run"
        elif err.path != last:      # a copy: checkpoint_last.pt of this update was written
            resumes = f"{last} holds update {updates} and resumes it"
        elif err.kept:
            saved = self._saved if self._saved is not None else _updates_in(last)
            resumes = "it resumes" + (f" from update {saved}" if saved is not None else "")
        else:
            resumes = "no checkpoint resumes this run: the same command starts afresh"
        again = "run the same command again"
        if err.kept or err.path != last:
            if os.path.abspath(files.restore_path(self.where)) != last:
                again += f" with --restore-file {last}"
            again += " to resume"
        return UserError(f"{err.what()}; {err.previous()}; {resumes}; training stops at update "
                         f"{updates}. {err.fix()}, then {again}")

    def _state(self, components, rngs):
        state = {"format": files.FORMAT, "args": self.flags, **components, RNG: rngs,
                 "best": self.best}
        state.update(self.entries)
        return state

    def local_state(self, given=None):
        """This rank's state in the checkpoint format, with no collective (the
        process group may be broken: an elastic member's snapshot, --zero 0).
        ``given``: {component name: its state} for those the caller supplies."""
        given = given or {}
        components = {name: given[name] if name in given else component.state_dict()
                      for name, component in self.components.items()}
        return self._state(components, [rng_state()])

    def has_best(self):
        """Whether checkpoint_best.pt exists (as rank 0 sees it)."""
        return not self.where.no_save and self.ctx.is_main and os.path.exists(self._best_path())

    def best_state(self):
        """checkpoint_best.pt (rank 0; None elsewhere or when there is none)."""
        return files.load(self._best_path()) if self.has_best() else None

    def _best_path(self):
        return os.path.join(self.where.save_dir, "checkpoint_best.pt")

    def _improves(self, metric):
        if self.best is None:
            return True
        return metric > self.best if self.cfg.maximize_best_checkpoint_metric else \
            metric < self.best


def save_dir(args):
    """--save-dir, by default checkpoints/<task> (the task's ``save_name``)."""
    return args.save_dir or os.path.join("checkpoints", TASKS.get(args.task).save_name(args))


@section
class SaveConfig(Section):
    """Where this node keeps checkpoints and the balance log."""
    save_dir: str = flag(None, metavar="DIR",
                         help="where checkpoints, balance.jsonl and TensorBoard go (default: "
                              "checkpoints/<task>; glue's named for its model too)")
    restore_file: str = flag("checkpoint_last.pt", metavar="FILE",
                             help="checkpoint to resume from, relative to --save-dir unless "
                                  "absolute (default: checkpoint_last.pt; a missing file starts "
                                  "afresh)")
    no_save: bool = flag(False, action="store_true", help="do not write checkpoints")

    @classmethod
    def from_args(cls, args):
        return super().from_args(args, save_dir=save_dir(args))
