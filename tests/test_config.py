"""The flags split into the job's configuration and the node's, once."""

import pickle

import pytest

from hetseq import cli, config
from hetseq.errors import UserError
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


def test_each_flag_has_one_section_and_one_default():
    """A flag is a field of one section only (--lr is the schedule's, --update-freq
    the loop's), and its default is the parser's alone: a check that tells a
    given flag from an absent one reads the parser's default, so changing a
    default in its declaration leaves the check right."""
    import dataclasses
    sections = [*config.JOB_SECTIONS.values(), *config.NODE_SECTIONS.values()]
    owners = {}
    for section in sections:
        for field in dataclasses.fields(section):
            owners.setdefault(field.name, []).append(section.__name__)
    assert {name: where for name, where in owners.items() if len(where) > 1} == {}
    parser = cli.build_parser()
    for action in parser._actions:
        if action.dest in ("outer_lr", "powersgd_rank"):
            action.default = {"outer_lr": 0.5, "powersgd_rank": 8}[action.dest]
    defaults = {action.dest: action.default for action in parser._actions}
    args = parser.parse_args([*map(str, TOY)])
    args.__class__ = cli.Flags
    cli.check_args(args, defaults)      # the new defaults count as not given
    with pytest.raises(UserError, match="--outer-lr set the outer step"):
        cli.check_args(parser.parse_args([*map(str, TOY), "--outer-lr", "0.7"]), defaults)


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
