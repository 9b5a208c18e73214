"""A node's own flags never change what the ranks do together.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/app/test_per_node_flags.py."""


import pytest
import torch

from machinery.jobs import run_jobs
from machinery.recording import seen_from_both_ends

from machinery.commands import assert_ok, final_params, run_job
from machinery.in_process import alone, max_diff
from machinery.settings import TOY
from unit.app.test_per_node_flags import VARIED


BASE = [*TOY, "--optimizer", "sgd", "--lr", "0.2", "--lr-scheduler", "fixed", "--max-update", 4,
        "--toy-size", 100, "--max-sentences", 16, "--distributed-timeout", 60]


TIMEOUT = 60


MODES = {"zero0": [], "zero1": ["--zero", 1], "zero2": ["--zero", 2], "zero3": ["--zero", 3]}


def _flags(name, value, folder):
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    return [flag, str(value).format(dir=folder)]


def _argv(extra, varied, rank, folder):
    """Rank ``rank``'s command line: BASE, ``extra``, and its value of each
    flag in ``varied`` (every other per-node flag at rank 0's value); files
    under ``folder``, one per job (a job must not resume another's run)."""
    argv = [*BASE, *extra, "--save-dir", f"{folder}/node{rank}"]
    for name in varied:
        argv += _flags(name, VARIED[name][rank], folder)
    return [str(a) for a in argv]


def reference(extra, global_batch):
    """The weights of one process training on the same global batch."""
    return alone(*BASE, *extra, "--max-sentences", global_batch)["model"]


def check(extra, name, result):
    updates = result.updates()
    assert len(updates) == 4 and all(updates.values()), (name, result.calls[0])
    assert seen_from_both_ends(result.calls[0]) == seen_from_both_ends(result.calls[1]), \
        f"{name}: the ranks issued different collectives"
    ref = reference(extra, result.global_batch)
    # float64 toy model: only the order of summation differs from one process.
    diff = max((result.state["model"][k] - ref[k]).abs().max().item() for k in ref)
    assert diff < 1e-10, (name, diff)


# Loader processes take seconds to start: --num-workers is varied alone.
ALL_AT_ONCE = [name for name in VARIED if name != "num_workers"]


def _jobs_of(mode, tmp_path):
    """(name, clip, argv per rank): all per-node flags differing at once,
    clipped or not, and under --zero 3 each flag alone (the mode whose
    collectives a node's flag changed once: its norm, its gathers)."""
    jobs = [(f"{mode}, clip {clip}: all flags", clip,
             [_argv([*MODES[mode], "--clip-norm", clip], ALL_AT_ONCE, r,
                    tmp_path / f"{mode}-all-{clip}") for r in (0, 1)]) for clip in (0, 0.5)]
    if mode == "zero3":
        jobs += [(f"{mode}, clip 0: {name}", 0,
                  [_argv([*MODES[mode], "--clip-norm", 0], [name], r, tmp_path / f"{mode}-{name}")
                   for r in (0, 1)]) for name in VARIED]
    return jobs


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Every job of every mode, run by one pair of processes."""
    tmp_path = tmp_path_factory.mktemp("per-node")
    jobs = [job for mode in MODES for job in _jobs_of(mode, tmp_path)]
    return tmp_path, run_jobs(2, [(name, argvs) for name, _, argvs in jobs], tmp_path / "runner",
                         timeout=TIMEOUT)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_per_node_flags_never_change_the_collectives(recorded, mode):
    tmp_path, results = recorded
    for name, clip, _ in _jobs_of(mode, tmp_path):
        check([*MODES[mode], "--clip-norm", clip], name, results[name])


@pytest.mark.parametrize("zero", [0, 3])
def test_every_rank_takes_the_same_update_path(tmp_path, zero):
    """Two real nodes: TensorBoard on rank 0's node only, another log interval
    on the other. With --clip-norm 0 that must not change how the gradients
    are scaled or which collectives run: every rank must hold bit-identical
    parameters. (The toy model is float64; scaling by a float64 factor on one
    rank and a float32 one on the other drifted apart; under --zero 3 the
    rank that showed the norm made one more all-reduce.)"""
    recipe = [*TOY, "--max-update", 6, "--clip-norm", 0, "--lr", 0.1, "--optimizer", "sgd",
              "--disable-validation"]
    common = [*recipe, "--zero", zero, "--save-dir", tmp_path / "ckpt",
              "--toy-dump-params", tmp_path / "params"]
    # 8 + 5 samples: the factor 2/13 is not exact in float32.
    assert_ok(run_job(common, [["--max-sentences", 8, "--tensorboard-logdir", tmp_path / "tb"],
                               ["--max-sentences", 5, "--log-interval", 1000]], timeout=120))
    rank0, rank1 = (torch.load(f"{tmp_path / 'params'}.{r}") for r in (0, 1))
    if zero == 0:     # under --zero 3 each rank holds other shards
        assert all(torch.equal(a, b) for a, b in zip(rank0, rank1)), \
            max((a - b).abs().max().item() for a, b in zip(rank0, rank1))
    # Both ways, the weights of one process training on the 13 samples.
    ref = alone(*recipe, "--max-sentences", 13)["model"]
    assert max_diff(ref, final_params(tmp_path / "ckpt")) < 1e-10
