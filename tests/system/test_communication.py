"""What each update sends, counted: every collective a rank issues is recorded
(tests/machinery/recording.py) and pinned here against the README's promises.

- The stats (loss, counts, logs, per-rank slots) travel in ONE float64
  all-reduce per update.
- Gradients are exchanged once per update, whatever --update-freq and
  however many micro-batches a rank accumulates locally: DDP all-reduces the
  whole gradient (--zero 0/1); FSDP reduce-scatters it (--zero 2/3), and the
  norm and overflow flag of the sharded gradient add one all-reduce of two
  numbers.
- FSDP gathers the parameters for every forward (and, --zero 3, again for
  every backward): that is the price of sharding them, counted per
  micro-batch.
- --zero 1 broadcasts each updated parameter from the rank that owns its
  optimizer state.
"""

import collections
import dataclasses

import pytest

from machinery.jobs import run_jobs
from machinery.recording import seen_from_both_ends
from hetseq.update.stats import RankReport

from machinery.settings import EXACT_SGD

BASE = [*EXACT_SGD, "--max-update", 3, "--no-save"]
PARAMS = 8 * 16 + 16 + 16 + 1                # the toy model: Linear(8, 16), Linear(16, 1)
# loss, sample_size, seen; then each field of RankReport, one slot per rank (2)
STATS = 3 + len(dataclasses.fields(RankReport)) * 2
# In this order: a bug that makes ranks issue different collectives (a sync
# on every micro-batch of an uneven split) crashes the "micro-batches" jobs;
# the --update-freq ones, equal on both ranks, show it as a count first.
VARIANTS = {"update-freq 3": ["--update-freq", 3], "plain": [],
            "micro-batches of 4": ["--micro-batch-cap", 4]}
UPDATES = 3
_RECORDED = {}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The recorded jobs of one variant (every --zero mode), run on first use:
    a variant whose jobs crash fails its own tests only."""
    def jobs_of(variant):
        if variant not in _RECORDED:
            jobs = [(f"zero{zero} {variant}", [[*BASE, "--zero", zero, *VARIANTS[variant],
                                                "--max-sentences", batch] for batch in (16, 8)])
                    for zero in (0, 1, 2, 3)]
            _RECORDED[variant] = run_jobs(2, jobs, tmp_path_factory.mktemp("communication"))
        return _RECORDED[variant]
    return lambda zero, variant: jobs_of(variant)[f"zero{zero} {variant}"]


def micro_batches(variant, update):
    """Micro-batches each rank runs in ``update`` (100 samples, global batch
    24: updates of 24 samples, or of 72 + 28 with --update-freq 3; rank 0's
    16 in 4 micro-batches of 4 with --micro-batch-cap 4, and everyone pads to
    that when forwards communicate)."""
    if variant == "update-freq 3":
        return 3 if update != 2 else 2
    return 4 if variant == "micro-batches of 4" else 1


def ops(calls):
    return collections.Counter((call.op, call.tensors) for call in calls)


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_replicas_exchange_the_gradient_once_per_update(recorded, zero, variant):
    result = recorded(zero, variant)
    assert seen_from_both_ends(result.calls[0]) == seen_from_both_ends(result.calls[1])
    assert len(result.updates()) == UPDATES
    for label, calls in result.updates().items():
        counts = ops(calls)
        assert counts.pop(("allreduce", (("float64", STATS),))) == 1, (label, calls)
        assert counts.pop(("allreduce", (("float64", PARAMS),))) == 1, (label, calls)
        # DDP's own bookkeeping: it settles its buckets once, in the second
        # update, by broadcasting rank 0's order as integers (no gradient data).
        own = collections.Counter(("broadcast", call.tensors) for call in calls
                                  if call.op == "broadcast"
                                  and all(dtype.startswith("int") for dtype, _ in call.tensors))
        assert bool(own) == (label == "update 2"), (label, own)
        counts -= own
        if zero == 1:                # each updated parameter, from its owner
            sent = [call.tensors for call in calls if call.op == "broadcast"
                    and call.tensors[0][0] == "float64"]
            assert sum(numel for (_, numel), in sent) == PARAMS
            counts -= collections.Counter(("broadcast", tensors) for tensors in sent)
        assert not counts, (label, counts)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_gradients_are_reduce_scattered_once_per_update(recorded, zero, variant):
    result = recorded(zero, variant)
    assert seen_from_both_ends(result.calls[0]) == seen_from_both_ends(result.calls[1])
    assert len(result.updates()) == UPDATES
    padded = 2 * -(-PARAMS // 2)                        # FSDP pads to a multiple of W
    shard = (("float64", padded // 2), ("float64", padded))
    for label, calls in result.updates().items():
        counts = ops(calls)
        assert counts.pop(("allreduce", (("float64", STATS),))) == 1, (label, calls)
        assert counts.pop(("reduce_scatter_single", shard)) == 1, (label, calls)
        assert counts.pop(("allreduce", (("float64", 2),))) == 1, (label, calls)   # norm, flag
        gathers = micro_batches(variant, int(label.split()[1])) * (1 if zero == 2 else 2)
        assert counts.pop(("all_gather_single", tuple(reversed(shard)))) == gathers, label
        assert not counts, (label, counts)
