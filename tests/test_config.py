"""The flags split into the job's configuration and the node's, once."""

import pickle

import pytest

from hetseq import cli, config
from hetseq.tasks import TASKS

from conftest import ROOT, TOY

MNIST = ["--task", "mnist", "--user-dir", str(ROOT / "examples" / "mnist")]


@pytest.mark.parametrize("argv", [TOY, MNIST, ["--task", "bert"], ["--task", "glue"]],
                         ids=["toy", "mnist", "bert", "glue"])
def test_every_flag_is_the_jobs_or_the_nodes(argv):
    args, job, node = cli.parse(list(map(str, argv)))
    job_flags, node_flags = set(job.flags()), set(node.flags())
    assert not job_flags & node_flags
    assert job_flags | node_flags | config.NO_EFFECT >= set(vars(args))
    assert (job_flags | node_flags) - {"task"} <= set(vars(args))
    task_cls = TASKS.get(args.task)
    own = set(cli.task_dests(task_cls))
    assert {name for name, _ in node.task_flags} == own & task_cls.per_node_flags
    assert {name for name, _ in job.task_flags} == own - task_cls.per_node_flags


def test_the_identity_is_the_job_config_and_leaves_the_node_out():
    _, job, node = cli.parse([*TOY, "--seed", "3", "--max-sentences", "8"])
    identity = job.identity()
    assert identity["seed"] == 3 and "max_sentences" not in identity
    assert set(identity) - {"hetseq_version", "hetseq_code"} == set(job.flags())
    assert not set(identity) & config.per_node_flags(node)


def test_a_node_flag_never_changes_the_job():
    base = cli.parse([*TOY])[1]
    for argv in (["--max-sentences", "64"], ["--tensorboard-logdir", "tb"], ["--cpu"],
                 ["--log-interval", "7"], ["--save-dir", "x"], ["--bucket-cap-mb", "25"],
                 ["--toy-slow-rank", "1"]):
        assert cli.parse([*TOY, *argv])[1] == base, argv
    assert cli.parse([*TOY, "--bucket-cap-mb", "5"])[1] != base   # DDP's buckets pair up


def test_flags_are_read_only_and_derived_values_live_in_the_configs():
    args, job, node = cli.parse([*TOY, "--max-sentences", "8", "--log-format", "json",
                                 "--best-checkpoint-metric", "accuracy"])
    with pytest.raises(AttributeError, match="read-only"):
        args.max_sentences_valid = 4
    assert args.max_sentences_valid is None and node.shares.max_sentences_valid == 8
    assert not args.no_progress_bar and node.log.no_progress_bar
    assert args.maximize_best_checkpoint_metric is None
    assert job.checkpoint.maximize_best_checkpoint_metric
    assert pickle.loads(pickle.dumps(args)) == args       # spawned ranks receive them
    with pytest.raises(AttributeError):
        job.training.seed = 1
