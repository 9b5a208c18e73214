"""A node's own flags never change what the ranks do together.

Every per-node flag (NodeConfig, config.py) is set to different values on
the two ranks of a job, one flag at a time and all at once, under every
--zero mode, with and without clipping. Each rank's collectives are recorded
(hetseq/testing/recording.py): both ranks must issue the same ones, in the
same order and sizes, update by update, and the weights must equal one
process training on the same global batch. Were a per-node flag to reach the
update path, the ranks would pair different collectives: a hang, an error,
or wrong numbers (as --tensorboard-logdir on one node did under --zero 2/3
with --clip-norm 0: one rank measured the sharded norm, one more all-reduce).
"""

import datetime
import gc

import pytest
import torch

from hetseq import cli, config

from conftest import TOY, assert_ok, leave_process_group, run_job

# Rank 0's and rank 1's value of each per-node flag the Run sees (None: not
# given; True/False: a switch). The launch flags decide which process is
# which rank before the Run starts, and cannot differ inside one process
# pair; the task's own per-node flags are the task's promise.
VARIED = {
    "max_sentences": (16, 8),
    "max_sentences_valid": (4, 7),
    "capacity_weight": (1, 3),
    "micro_batch_cap": (0, 3),
    "max_memory_gb": (None, 0.5),
    "num_workers": (0, 1),
    "data": (None, "{dir}"),
    "save_dir": ("{dir}/node0", "{dir}/node1"),
    "restore_file": (None, "elsewhere.pt"),
    "no_save": (False, True),
    "log_interval": (1, 1000),
    "log_format": ("tqdm", "json"),
    "log_all_ranks": (False, True),
    "no_progress_bar": (False, True),
    "tensorboard_logdir": ("{dir}/tb", None),
    "no_tensorboard": (True, False),
}
NOT_IN_A_RUN = {f.name for f in config.dataclasses.fields(config.LaunchConfig)} | {"user_dir"}
BASE = [*TOY, "--optimizer", "sgd", "--lr", "0.2", "--lr-scheduler", "fixed", "--max-update", 4,
        "--toy-size", 100, "--max-sentences", 16, "--distributed-timeout", 60]
TIMEOUT = 60
MODES = {"zero0": [], "zero1": ["--zero", 1], "zero2": ["--zero", 2], "zero3": ["--zero", 3]}


def test_the_varied_flags_are_every_per_node_flag():
    _, _, node = cli.parse(list(map(str, TOY)))
    task_flags = {name for name, _ in node.task_flags}
    assert set(VARIED) | NOT_IN_A_RUN == config.per_node_flags(node) - task_flags


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


def _mark_updates(controller):
    """A marker before and after each update in the recording."""
    from hetseq.testing import recording
    step = controller.train_step

    def marked(*args, **kwargs):
        recording.mark(f"update {controller.num_updates + 1}")
        result = step(*args, **kwargs)
        recording.mark("between updates")
        return result
    controller.train_step = marked


def _jobs(rank, world, init, jobs, out):
    """Rank ``rank`` of every job in ``jobs`` ([(name, [argv per rank])]), one
    after the other in this process: its collectives, rank 0's final weights
    and the global batch, saved to ``out``.<rank> (a queue's pipe would block
    on this much data until the parent reads, and it reads after the join)."""
    from hetseq.distributed import DistContext
    from hetseq.testing import recording
    from hetseq.train import Run
    torch.set_num_threads(1)
    recording.register()
    torch.distributed.init_process_group(recording.BACKEND, init_method=init, rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT))
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    results = {}
    for name, argvs in jobs:
        recording.clear()
        args, job, node = cli.parse(argvs[rank])
        run = Run(args, job, node, ctx)
        _mark_updates(run.controller)
        run.train()
        calls = recording.calls()
        weights = run.controller.sharding.model_state(run.controller.model)   # a collective
        results[name] = (calls, weights if rank == 0 else None, run.balance.plan.global_batch)
        del run
        gc.collect()
    torch.save(results, f"{out}.{rank}")
    leave_process_group()


def run_jobs(tmp, jobs):
    """{name: (calls per rank, weights, global batch)} of 2-rank jobs."""
    import torch.multiprocessing as mp
    mp.start_processes(_jobs, args=(2, f"file://{tmp / 'meet'}", jobs, tmp / "recorded"),
                       nprocs=2, start_method="spawn")
    by_rank = [torch.load(f"{tmp / 'recorded'}.{rank}", weights_only=False) for rank in (0, 1)]
    return {name: ([by_rank[r][name][0] for r in (0, 1)], by_rank[0][name][1],
                   by_rank[0][name][2]) for name, _ in jobs}


_REFERENCES = {}


def reference(tmp, extra, global_batch):
    """The weights of one process training on the same global batch."""
    from hetseq.distributed import DistContext
    from hetseq.train import Run
    key = (tuple(map(str, extra)), global_batch)
    if key not in _REFERENCES:
        args, job, node = cli.parse([str(a) for a in (*BASE, *extra, "--max-sentences",
                                                      global_batch, "--no-save")])
        run = Run(args, job, node, DistContext(0, 1, 0, torch.device("cpu")))
        run.train()
        _REFERENCES[key] = run.controller.model.state_dict()
    return _REFERENCES[key]


def check(tmp, extra, name, result):
    (calls0, calls1), weights, global_batch = result
    from hetseq.testing.recording import sections
    updates = sections(calls0, "update ")
    assert len(updates) == 4 and all(updates.values()), (name, calls0)
    assert calls0 == calls1, f"{name}: the ranks issued different collectives"
    ref = reference(tmp, extra, global_batch)
    # float64 toy model: only the order of summation differs from one process.
    diff = max((weights[k] - ref[k]).abs().max().item() for k in ref)
    assert diff < 1e-10, (name, diff)


# Loader processes take seconds to start: --num-workers is varied alone.
ALL_AT_ONCE = [name for name in VARIED if name != "num_workers"]


def _jobs_of(mode, tmp):
    """(name, clip, argv per rank): all per-node flags differing at once,
    clipped or not, and under --zero 0 and 3 each flag alone."""
    jobs = [(f"{mode}, clip {clip}: all flags", clip,
             [_argv([*MODES[mode], "--clip-norm", clip], ALL_AT_ONCE, r,
                    tmp / f"{mode}-all-{clip}") for r in (0, 1)]) for clip in (0, 0.5)]
    if mode in ("zero0", "zero3"):
        jobs += [(f"{mode}, clip 0: {name}", 0,
                  [_argv([*MODES[mode], "--clip-norm", 0], [name], r, tmp / f"{mode}-{name}")
                   for r in (0, 1)]) for name in VARIED]
    return jobs


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Every job of every mode, run by one pair of processes."""
    tmp = tmp_path_factory.mktemp("per-node")
    jobs = [job for mode in MODES for job in _jobs_of(mode, tmp)]
    return tmp, run_jobs(tmp, [(name, argvs) for name, _, argvs in jobs])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_per_node_flags_never_change_the_collectives(recorded, mode):
    tmp, results = recorded
    for name, clip, _ in _jobs_of(mode, tmp):
        check(tmp, [*MODES[mode], "--clip-norm", clip], name, results[name])


@pytest.mark.parametrize("zero", [0, 3])
def test_every_rank_takes_the_same_update_path(tmp, zero):
    """Two real nodes: TensorBoard on rank 0's node only, another log interval
    on the other. With --clip-norm 0 that must not change how the gradients
    are scaled or which collectives run: every rank must hold bit-identical
    parameters. (The toy model is float64; scaling by a float64 factor on one
    rank and a float32 one on the other drifted apart; under --zero 3 the
    rank that showed the norm made one more all-reduce.)"""
    common = [*TOY, "--max-update", 6, "--clip-norm", 0, "--lr", 0.1, "--zero", zero,
              "--optimizer", "sgd", "--disable-validation", "--no-save",
              "--toy-dump-params", tmp / "params"]
    # 8 + 5 samples: the factor 2/13 is not exact in float32.
    assert_ok(run_job(common, [["--max-sentences", 8, "--tensorboard-logdir", tmp / "tb"],
                               ["--max-sentences", 5, "--log-interval", 1000]], timeout=120))
    rank0, rank1 = (torch.load(f"{tmp / 'params'}.{r}") for r in (0, 1))
    if zero == 0:
        assert all(torch.equal(a, b) for a, b in zip(rank0, rank1)), \
            max((a - b).abs().max().item() for a, b in zip(rank0, rank1))
