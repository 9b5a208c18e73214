"""A task's loss that reads the model's parameters before calling it (weight
logging, a regulariser, an EMA), in every --zero mode and state shares
(issue 58: --zero 3 --state-shares memory crashed both ranks reading freed
storage). Outside forward a parameter is its whole weight (--zero 0/1) or
this rank's shard; Task.full_weights gives the whole weights everywhere and
keeps what the task writes into them (docs/tasks.md, 'Reading the weights
in `loss`').

One process group of 2 ranks trains each mode in turn (1:3 shares by
memory, uneven batches of 3 and 4+5 samples): the update, the shards read
and the context's weights are those of one process training on all 12."""

import pytest
import torch

from machinery.in_process import build_controller, keyed, leave_process_group, start_ranks
from machinery.settings import EXACT, EXACT_SGD, GROUP_TIMEOUT

ARGV = [*EXACT_SGD, "--toy-blocks", 2]
SHARES = [0.25, 0.75]
# (--zero, state shares: None even, else by memory)
MODES = [(0, None), (1, None), (1, SHARES), (2, None), (2, SHARES), (3, None), (3, SHARES)]
UPDATES = 2
# The context's write: idempotent (the ranks run 2 micro-batches, one process
# 1), and it binds (the first Linear's weights start within +-0.35).
CLAMP = 0.3
ROWS = [list(range(3)), list(range(3, 7)), list(range(7, 12))]      # rank 0; rank 1's two


def _reading(task, controller, seen):
    """``task.loss`` that first reads every parameter (as a weight log
    does), then clamps the whole weights in ``full_weights``, and keeps, per
    update, what the first call read and what the context held."""
    from torch.distributed.tensor import DTensor
    plain = task.loss
    kept = {}

    def loss(model, sample):
        update = controller.num_updates
        read = []
        for param in model.parameters():
            float(param.detach().abs().sum())       # freed storage: a segfault (issue 58)
            if isinstance(param, DTensor):
                (placement,) = param.placements
                read.append((param.to_local().detach().clone(), placement.dim))
            else:
                read.append((param.detach().clone(), None))
        with task.full_weights(model) as weights:
            for weight in dict.fromkeys(weights.values()):     # a tied one once
                weight.clamp_(-CLAMP, CLAMP)
            held = {name: weight.detach().cpu().clone() for name, weight in weights.items()}
        # The tensors kept past the context (a snapshot, an EMA's source), now
        # and an update later: over storage that holds them (checked before
        # reading: freed storage segfaults), still what the context held.
        kept.setdefault(update, (weights, held))
        for when, (tensors, values) in kept.items():
            valid = _valid(tensors)
            seen.setdefault("kept", set()).add((update, when, valid, valid and all(
                torch.equal(tensors[name].detach().cpu(), values[name]) for name in values)))
        # A module inside the model: its own names (the whole model gathered).
        with task.full_weights(getattr(model, "module", model).blocks[1]) as weights:
            block = {name: weight.detach().cpu().clone() for name, weight in weights.items()}
        seen.setdefault(update, (read, held, block))
        return plain(model, sample)
    task.loss = loss


def _valid(tensors):
    """Whether every tensor's storage holds its elements."""
    return all(w.untyped_storage().nbytes() >= (w.storage_offset() + w.numel()) * w.element_size()
               for w in tensors.values())


def _train(controller, task, batches, dummy):
    seen = {}
    _reading(task, controller, seen)
    for update in range(UPDATES):
        controller.train_step(batches(update), dummy)
    return seen


def _rows(update, rows):
    return [12 * update + row for row in rows]


def _every_mode(rank, world, folder):
    """Rank ``rank``: each mode trained UPDATES updates; what the loss saw,
    the final full weights, and the refusal of a forward inside the context,
    saved in ``folder`` (a queue's pipe would block on this much data: the
    parent reads after the ranks end)."""
    import torch.distributed as dist

    from hetseq.app import cli
    from hetseq.distributed.spawn import DistContext
    from hetseq.base.errors import UserError
    from hetseq.tasks import TASKS
    from hetseq.update.controller import Controller
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/meet", rank=rank,
                            world_size=world, timeout=GROUP_TIMEOUT)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    results = {}
    for zero, shares in MODES:
        args, job, _ = cli.parse([str(a) for a in [*ARGV, "--zero", zero]])
        task = TASKS.get(args.task)(args)
        controller = Controller(job, task, task.build_model(), ctx, state_shares=shares)
        data = task.load_dataset("train")
        mine = [ROWS[0]] if rank == 0 else ROWS[1:]

        def batches(update, data=data, mine=mine):
            parts = [keyed(data, _rows(update, rows)) for rows in mine]
            return parts + [None] * (2 - len(parts))     # rank 0 pads where forwards gather
        seen = _train(controller, task, batches, keyed(data, ROWS[0]))
        seen["gradient bytes"] = controller.gradient_bytes()    # the links' probes: whole
        final = controller.full_model_state()
        refused = None
        if zero >= 2:
            try:
                with task.full_weights(controller.wrapped):
                    controller.model(data.x[:2])
            except UserError as err:
                refused = str(err)
        results[(zero, shares is not None)] = (seen, final, refused)
        del controller
    results["regulariser"] = _regulariser_by_memory(ctx, rank)
    torch.save(results, f"{folder}/results.{rank}")
    leave_process_group()


def _regulariser_by_memory(ctx, rank):
    """What a loss adding ``sum(p.pow(2).sum())`` over ``model.parameters()``
    after the forward gets under --zero 3 by memory (last: the update dies
    on every rank): the UserError's text, another error's, or None."""
    from hetseq.app import cli
    from hetseq.base.errors import UserError
    from hetseq.tasks import TASKS
    from hetseq.update.controller import Controller
    args, job, _ = cli.parse([str(a) for a in [*ARGV, "--zero", 3]])
    task = TASKS.get(args.task)(args)
    controller = Controller(job, task, task.build_model(), ctx, state_shares=SHARES)
    plain = task.loss

    def loss(model, sample):
        value, *rest = plain(model, sample)
        return (value + 0.05 * sum((p.float() ** 2).sum() for p in model.parameters()), *rest)
    task.loss = loss
    data = task.load_dataset("train")
    parts = [keyed(data, rows) for rows in ([ROWS[0]] if rank == 0 else ROWS[1:])]
    try:
        controller.train_step(parts + [None] * (2 - len(parts)), keyed(data, ROWS[0]))
    except UserError as err:
        return str(err)
    except Exception as err:       # autograd's own, mid-backward: the process group is done
        return f"{type(err).__name__}: {err}"
    return None


@pytest.fixture(scope="module")
def one_process():
    """What one process training on all 12 samples per update reads and holds."""
    from hetseq.distributed.spawn import DistContext
    controller, task = build_controller(ARGV, DistContext(0, 1, 0, torch.device("cpu")))
    data = task.load_dataset("train")
    everything = sorted(row for rows in ROWS for row in rows)
    seen = _train(controller, task, lambda update: [keyed(data, _rows(update, everything))],
                  keyed(data, everything))
    seen["gradient bytes"] = controller.gradient_bytes()
    return seen, {k: v.clone() for k, v in controller.model.state_dict().items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parameters-in-loss")
    start_ranks(_every_mode, 2, 2, str(folder))
    return [torch.load(folder / f"results.{rank}", weights_only=False) for rank in (0, 1)]


def _whole(parts, flat_shape, sharded_dim):
    """The whole parameter from each rank's part of it."""
    if sharded_dim is not None:
        return torch.cat(parts, sharded_dim)
    return torch.cat([part.reshape(-1) for part in parts]).view(flat_shape)


@pytest.mark.parametrize("zero, by_memory", [(z, s is not None) for z, s in MODES])
def test_a_loss_reading_every_parameter_updates_as_one_process(one_process, two_ranks, zero,
                                                               by_memory):
    """Each rank reads each parameter before the forward: the whole weight
    under --zero 0/1, this rank's shard under 2/3 (a DTensor's chunk with
    even shares; its range of the flat unit by memory: the ranks' parts
    laid end to end are the weight). The context's whole weights, clamped
    in it, are one process's at every update, and so is the final model."""
    reference, final_reference = one_process
    names = list(reference[0][1])
    assert any(not torch.equal(reference[0][0][i][0], reference[0][1][name])
               for i, name in enumerate(names)), "the clamp binds nowhere: writes untested"
    for rank in (0, 1):
        seen, final, refused = two_ranks[rank][(zero, by_memory)]
        assert seen["gradient bytes"] == reference["gradient bytes"]
        assert sorted(k for k in seen if k not in ("gradient bytes", "kept")) == \
            list(range(UPDATES))
        for update in range(UPDATES):
            read, held, block = seen[update]
            whole_read, whole_held, _ = reference[update]
            assert list(held) == names
            for name in names:
                assert (held[name] - whole_held[name]).abs().max() < EXACT, (update, name)
            assert sorted(block) == sorted(n[len("blocks.1."):] for n in names
                                           if n.startswith("blocks.1."))
            for name in block:
                assert torch.equal(block[name], held[f"blocks.1.{name}"]), (update, name)
            theirs = two_ranks[1 - rank][(zero, by_memory)][0][update][0]
            for (part, dim), (other, _), (whole, _) in zip(read, theirs, whole_read):
                if zero < 2:
                    assert part.shape == whole.shape and (part - whole).abs().max() < EXACT
                    continue
                parts = [part, other] if rank == 0 else [other, part]
                assert (_whole(parts, whole.shape, dim) - whole).abs().max() < EXACT
        if rank == 0:
            assert max((final[k] - final_reference[k]).abs().max() for k in final_reference) \
                < EXACT
        if zero >= 2:
            assert refused and "leave it before calling the model" in refused, refused


@pytest.mark.parametrize("zero, by_memory", [(z, s is not None) for z, s in MODES])
def test_weights_kept_past_full_weights_stay_valid(two_ranks, zero, by_memory):
    """A tensor of full_weights kept past the context (a snapshot, an EMA's
    source) lies over storage that holds it, in the update it was taken and
    the next: under --zero 2/3 by memory they were views of a unit's
    ``full``, freed on leaving (reading one segfaulted). They hold what the
    context held: a copy under --zero 2/3 (so an update later too), the
    parameter itself under --zero 0/1."""
    for rank in (0, 1):
        kept = two_ranks[rank][(zero, by_memory)][0]["kept"]
        assert {(update, when) for update, when, _, _ in kept} == \
            {(u, w) for u in range(UPDATES) for w in range(u + 1)}
        for update, when, valid, same in kept:
            assert valid, (rank, update, when)
            assert same or (zero < 2 and when < update), (rank, update, when)


def test_a_regulariser_outside_forward_under_zero_3_by_memory_is_refused(two_ranks):
    """A regulariser over ``model.parameters()`` in ``loss`` under --zero 3
    by memory reads each unit's parameters freed (this rank's part): its
    gradient is refused on every rank with what to do instead, not autograd's
    'invalid gradient' mid-backward."""
    for rank in (0, 1):
        refused = two_ranks[rank]["regulariser"]
        assert refused and "outside the forward" in refused and "full_weights" in refused \
            and "inside the forward" in refused, (rank, refused)
