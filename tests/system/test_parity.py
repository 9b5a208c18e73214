"""The update must equal large-batch single-process training, whatever the split.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/update/test_parity.py."""

import pytest
import torch

from machinery.jobs import run_jobs

from machinery.commands import assert_ok, final_params, run_job
from machinery.in_process import (build_controller, leave_process_group, max_diff, rank_queue,
                                  start_ranks)
from machinery.settings import EXACT, GROUP_TIMEOUT
from machinery.parity import COMMON, params, reference


# Adam with a clip that binds (the state --zero 1 shards; the norm of the
# whole sharded gradient): exactness of everything but the scale.
ADAM = ["--optimizer", "adamw", "--lr", "0.05", "--weight-decay", "0.01", "--clip-norm", "0.3"]


MODES = {"zero0": [], "zero1": ["--zero", 1], "zero2": ["--zero", 2], "zero3": ["--zero", 3],
         "zero3-offload": ["--zero", 3, "--cpu-offload"]}


OPTIMIZERS = {"sgd": [], "adamw+clip": ADAM}


# bf16 autocast on a float32 model: each rank's sums over its own samples
# are rounded to bfloat16 (8 bits) inside its backward before the ranks are
# summed, where one process rounds the whole batch's sums once. After 7
# updates of lr 0.2 that is 6e-4 here (one bfloat16 step at the weights'
# size); bf16 against fp32 is 1.4e-3, and averaging the ranks' means with
# equal weights (plain DDP's mistake) lands further away than BF16_CLOSE.
BF16 = ["--toy-dtype", "float32", "--bf16"]


BF16_CLOSE = 2e-3


def job(layout, *extra):
    """A job of one rank per entry of ``layout`` (its batch)."""
    return [[*COMMON, *extra, "--max-sentences", batch, "--no-save"] for batch in layout]


TWO = {"equal 16+16": job([16, 16]),
       "mean loss 24+8": job([24, 8], "--toy-mean-loss"),
       "plain backward 24+8": job([24, 8], "--update-freq", 2, "--toy-plain-backward"),
       **{f"{mode} {opt} 24+8": job([24, 8], *MODES[mode], *OPTIMIZERS[opt])
          for mode in MODES for opt in OPTIMIZERS},
       **{f"{mode} bf16 24+8": job([24, 8], *MODES[mode], *BF16) for mode in ("zero0", "zero3")},
       "zero3 by memory bf16 24+8": job([24, 8], "--zero", 3, "--state-shares", "memory", *BF16),
       "mean loss bf16 24+8": job([24, 8], *BF16, "--toy-mean-loss"),
       **{f"{mode} compile 24+8": job([24, 8], *MODES[mode], "--compile")
          for mode in ("zero0", "zero3")}}


# 100 samples in batches of 32: the last global batch has 4 samples and splits
# 3 + 1 + 0, so rank 2 takes part with a zero-weight batch.
THREE = {f"{mode} {opt} 20+8+4": job([20, 8, 4], "--update-freq", 2, *MODES[mode],
                                     *OPTIMIZERS[opt]) for mode in MODES for opt in OPTIMIZERS}


# State shares by memory (--state-shares memory, update/zero/uneven.py): each rank
# holds the fraction of the split state its --max-memory-gb gives it (1:3,
# 1:1:6). --toy-blocks 2: units of their own, gathered and freed one by one
# under --zero 2/3; SGD with momentum, so --zero 1 splits a state too (the
# update is still linear in the gradient: a wrong scale shows).
SPLIT_MODES = ("zero1", "zero2", "zero3", "zero3-offload")


BY_MEMORY = ["--toy-blocks", 2, "--momentum", 0.5]


def by_memory(layout, memories, *extra):
    return [[*COMMON, *BY_MEMORY, *extra, "--max-sentences", batch, "--max-memory-gb", memory,
             "--no-save"] for batch, memory in zip(layout, memories)]


TWO.update({f"{mode} by memory 1:3 24+8": by_memory([24, 8], [0.001, 0.003], *MODES[mode])
            for mode in SPLIT_MODES})


# A spare layer per block that only micro-batches of more than 4 samples use:
# in the epoch's last update (2 + 2 samples) no rank gives it a gradient,
# and momentum and weight decay must leave it alone, as one process does.
SPARE = ["--toy-spare-above", 4, "--weight-decay", 0.1]


# (DDP, under --zero 1, needs --find-unused-parameters for that.)
TWO.update({f"{mode} by memory spare 16+16": by_memory(
    [16, 16], [0.001, 0.003], *SPARE, *MODES[mode],
    *(["--find-unused-parameters"] if mode == "zero1" else [])) for mode in SPLIT_MODES})


# A unit inside a unit (a list in each block) and a weight tied between the
# first block and the root: FSDP2 wraps the inner units first and leaves a
# unit holding a tied weight to the root; memory shares give it to the root.
# (At lr 0.2 this deeper model is chaotic: rounding grows 15x an update.)
NEST_TIE = ["--toy-nest", "--toy-tie", "--lr", 0.05]


TWO.update({f"{mode} nest tie 24+8": job([24, 8], *BY_MEMORY, *NEST_TIE, *MODES[mode])
            for mode in ("zero2", "zero3")})


TWO["zero3 by memory nest tie 1:3 24+8"] = by_memory([24, 8], [0.001, 0.003], *NEST_TIE,
                                                     *MODES["zero3"])


THREE.update({f"{mode} by memory 1:1:6 20+8+4": by_memory(
    [20, 8, 4], [0.001, 0.001, 0.006], "--update-freq", 2, *MODES[mode]) for mode in SPLIT_MODES})


# Rank 1 takes no sample of any global batch: weights 1000:1 round its share of
# 32 to nothing. Its first update runs a zero-weight batch (DDP builds its
# buckets from one backward; the stats' keys come from it), later ones none
# where the mode can take its part in the exchange without a forward.
IDLE_MODES = {"zero0": [], "zero1": ["--zero", 1], "zero3": ["--zero", 3],
              "zero1 by memory": ["--zero", 1, "--state-shares", "memory"],
              "zero3 by memory": ["--zero", 3, "--state-shares", "memory"],
              "bf16 reduce by memory": ["--zero", 3, "--state-shares", "memory",
                                        "--reduce-dtype", "bfloat16"],
              "local-steps": ["--local-steps", 2], "bf16 reduce": ["--reduce-dtype", "bfloat16"],
              "powersgd": ["--grad-compression", "powersgd", "--powersgd-start", 2,
                           "--powersgd-min-compression", 0, "--powersgd-rank", 8]}


# FSDP's forwards communicate, as those of --zero 3 by memory
FORWARDS_AFTER_THE_FIRST = {"zero3": 6, "zero3 by memory": 6, "bf16 reduce by memory": 6}


@pytest.fixture(scope="module")
def idle_rank(tmp_path_factory):
    folder = tmp_path_factory.mktemp("idle")
    jobs = [(mode, [[*COMMON, *extra, "--capacity", "manual", "--capacity-weight", weight,
                     "--global-batch-size", 32, "--no-save",
                     "--toy-log-forwards", folder / mode.replace(" ", "-")]
                    for weight in (1000, 1)]) for mode, extra in IDLE_MODES.items()]
    return folder, run_jobs(2, jobs, folder / "jobs")


@pytest.mark.parametrize("mode", sorted(IDLE_MODES))
def test_a_rank_without_samples_computes_nothing_and_the_update_stays_exact(idle_rank, mode):
    """The rank's updates after its first run no forward or backward (under
    FSDP one of no weight, as every forward communicates): its part of the
    gradient exchange is zeros, sent as DDP's own collectives, and the
    update is one process's, dropout included."""
    folder, results = idle_rank
    result = results[mode]
    assert result.global_batch == 32
    if mode.startswith("bf16 reduce"):       # gradients summed in bfloat16: close, not exact
        assert EXACT < max_diff(reference(), params(result.state)) < 1e-2
    else:
        assert max_diff(reference(), params(result.state)) < EXACT
    forwards = (folder / f"{mode.replace(' ', '-')}.1").read_text().split("\n")[:-1]
    # Shares by memory probe each rank's activations once, at start (run/shares.py).
    probe = ["1 1"] if "by memory" in mode else []
    assert forwards == probe + ["1 0.0"] * (1 + FORWARDS_AFTER_THE_FIRST.get(mode, 0)), forwards
    # The same collectives on both ranks, update by update.
    ops = [{name: [(call.op, call.tensors) for call in calls]
            for name, calls in result.updates(rank).items()} for rank in (0, 1)]
    assert ops[0] == ops[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_jobs(2, list(TWO.items()), tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return run_jobs(3, list(THREE.items()), tmp_path_factory.mktemp("three"))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_two_uneven_ranks_match_one_process(two_ranks, mode, opt):
    result = two_ranks[f"{mode} {opt} 24+8"]
    assert result.global_batch == 32
    assert max_diff(reference(*OPTIMIZERS[opt]), params(result.state)) < EXACT


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_three_uneven_ranks_with_accumulation_match_one_process(three_ranks, mode, opt):
    result = three_ranks[f"{mode} {opt} 20+8+4"]
    ref = reference("--update-freq", 2, *OPTIMIZERS[opt])
    assert max_diff(ref, params(result.state)) < EXACT


@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_state_shares_by_memory_match_one_process(two_ranks, three_ranks, mode):
    """Rank r holds its memory's fraction of the split state, counted from
    its own tensors (state_bytes), and the update is one process's."""
    two, three = two_ranks[f"{mode} by memory 1:3 24+8"], three_ranks[
        f"{mode} by memory 1:1:6 20+8+4"]
    ref = reference(*BY_MEMORY)
    assert max_diff(ref, params(two.state)) < EXACT
    assert max_diff(reference("--update-freq", 2, *BY_MEMORY), params(three.state)) < EXACT
    # Bytes of the parameters P; --zero 1 holds 2P whole (parameters and
    # gradients) and splits the momentum (P), --zero 2/3 split all 3P.
    size = sum(t.numel() * t.element_size() for t in ref.values())
    whole, split = (2 * size, size) if mode == "zero1" else (0, 3 * size)
    for result, fractions in ((two, (1 / 4, 3 / 4)), (three, (1 / 8, 1 / 8, 6 / 8))):
        expected = [whole + f * split for f in fractions]
        assert all(abs(held - want) < 0.01 * split for held, want
                   in zip(result.state_bytes, expected)), (result.state_bytes, expected)


@pytest.mark.parametrize("mode", ["zero2 nest tie 24+8", "zero3 nest tie 24+8",
                                  "zero3 by memory nest tie 1:3 24+8"])
def test_units_inside_units_and_weights_tied_to_the_root_match_one_process(two_ranks, mode):
    """Even shares (FSDP2) and shares by memory (HetSeq's own engine) on a
    model with a list inside each block and a weight tied to the root."""
    assert max_diff(reference(*BY_MEMORY, *NEST_TIE), params(two_ranks[mode].state)) < EXACT


@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_state_shares_by_memory_leave_a_parameter_without_gradient_alone(two_ranks, mode):
    """A parameter no rank gave a gradient in an update is not stepped (a
    rank's range is cut into one piece per parameter): the update is one
    process's, where momentum and weight decay skip it too."""
    assert max_diff(reference(*BY_MEMORY, *SPARE),
                    params(two_ranks[f"{mode} by memory spare 16+16"].state)) < EXACT


@pytest.mark.parametrize("mode", ["zero0", "zero3", "zero3 by memory"])
def test_bf16_on_two_uneven_ranks_stays_close_to_one_process(two_ranks, mode):
    ref, fp32 = reference(*BF16), reference("--toy-dtype", "float32")
    diff = max_diff(ref, params(two_ranks[f"{mode} bf16 24+8"].state))
    assert 0 < diff < BF16_CLOSE < 10 * max_diff(fp32, ref)   # autocast did change numbers
    wrong = max_diff(ref, params(two_ranks["mean loss bf16 24+8"].state))
    assert wrong > BF16_CLOSE, wrong                           # the tolerance sees a mistake


@pytest.mark.parametrize("mode", ["zero0", "zero3"])
def test_compiled_model_on_two_uneven_ranks_matches_one_process(two_ranks, mode):
    """--compile: inductor's kernels (and a second graph for the short last
    batch) give the update of the plain model, to the summation order."""
    result = two_ranks[f"{mode} compile 24+8"]
    assert max_diff(reference(), params(result.state)) < EXACT


def test_equal_split_matches_too(two_ranks):
    assert max_diff(reference(), params(two_ranks["equal 16+16"].state)) < EXACT


def test_task_overriding_train_step_without_stats_matches(two_ranks):
    # backward(loss) alone: the stats travel after backward instead of during it.
    ref = reference("--update-freq", 2)
    assert max_diff(ref, params(two_ranks["plain backward 24+8"].state)) < EXACT


def test_plain_mean_averaging_does_not_match(two_ranks):
    """Equal-weight averaging of per-rank means (plain DDP) is wrong when batches
    differ: the same run with the toy task's mean loss must NOT match."""
    assert max_diff(reference(), reference("--toy-mean-loss")) < EXACT   # one rank: the same
    assert max_diff(reference(), params(two_ranks["mean loss 24+8"].state)) > 1e-3


def nodes(tmp_path, name, layout, *extra):
    """One command per node; ``layout`` lists (processes, batch per process)."""
    out = tmp_path / name
    assert_ok(run_job([*COMMON, *extra, "--save-dir", out],
                      [(procs, ["--max-sentences", batch]) for procs, batch in layout]))
    return final_params(out)


# --find-unused-parameters: DDP's search for unreached parameters each backward.
@pytest.mark.parametrize("extra", [[], ["--find-unused-parameters"]])
def test_two_nodes_24_plus_8_match_one_process_32(tmp_path, extra):
    assert max_diff(reference(), nodes(tmp_path, "split", [(1, 24), (1, 8)], *extra)) < EXACT


def test_nodes_with_different_process_counts_match(tmp_path):
    # A node spawning 2 processes (8 each) and a node with 1 process (16).
    assert max_diff(reference(), nodes(tmp_path, "split", [(2, 8), (1, 16)])) < EXACT


def _count_collectives(rank, world, init, plain, out):
    """One rank: three updates of a 3 + 1 split, counting Python-level collectives."""
    import torch.distributed as dist
    from hetseq.distributed.spawn import DistContext
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    controller, task = build_controller([*COMMON, *(["--toy-plain-backward"] if plain else [])],
                                        DistContext(rank, world, rank, torch.device("cpu"), "gloo"))
    data = task.load_dataset("train")
    calls = []

    def record(name, real):
        def call(*a, **k):
            # Whether the collective starts before this update's backward has
            # produced any gradient.
            before = all(p.grad is None for p in controller.model.parameters())
            calls.append((name, "before backward" if before else "after backward"))
            return real(*a, **k)
        return call
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object"):
        setattr(dist, name, record(name, getattr(dist, name)))
    sizes = []
    for step in range(3):
        rows = list(range(4 * step, 4 * step + 4))[:3] if rank == 0 else [4 * step + 3]
        batch = {"x": data.x[rows], "y": data.y[rows]}
        sizes.append(controller.train_step([batch], batch).sample_size)
    out.put((rank, calls, sizes))
    del controller
    leave_process_group()


@pytest.mark.parametrize("plain", [False, True])
def test_stats_travel_in_one_all_reduce_started_before_backward(tmp_path, plain):
    """An update makes exactly one collective of its own: the stats all-reduce.
    With the stats passed to backward it starts before backward (and runs
    during it); a task calling backward(loss) alone starts it afterwards."""
    out = rank_queue()
    start_ranks(_count_collectives, 2, 2, f"file://{tmp_path / 'rendezvous'}", plain, out)
    when = "after backward" if plain else "before backward"
    for _ in range(2):
        rank, calls, sizes = out.get()
        assert sizes == [4, 4, 4]     # summed counts arrive exactly
        assert calls == [("all_reduce", when)] * 3, (rank, calls)
