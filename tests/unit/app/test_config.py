"""The flags split into the job's configuration and the node's, once."""

import ast
import collections
import dataclasses
import pickle

import pytest

from hetseq.app import cli, config
from hetseq.base import sections
from hetseq.base.errors import UserError
from hetseq.tasks import TASKS
from hetseq.update.exchange import EXCHANGES

from machinery.settings import ROOT, TOY

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
    owners = {}
    for section in [*config.JOB_SECTIONS.values(), *config.NODE_SECTIONS.values()]:
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


def _sections(cls=None):
    """Every Section class of hetseq/ (the configs import them all)."""
    for sub in (cls or sections.Section).__subclasses__():
        if sub.__module__.startswith("hetseq."):
            yield sub
        yield from _sections(sub)


def _add_argument_calls():
    """(where, dest or None) of every add_argument call in hetseq/ that is the
    training command's: calls in a function building another command's
    parser (ArgumentParser(prog="hetseq-status")...) are left out. dest is
    None where the option strings are not literals."""
    for path in sorted((ROOT / "hetseq").rglob("*.py")):
        tree = ast.parse(path.read_text())
        other = set()
        for func in ast.walk(tree):
            if isinstance(func, ast.FunctionDef) and any(
                    isinstance(call, ast.Call) and kw.arg == "prog"
                    and isinstance(kw.value, ast.Constant) and kw.value.value != "hetseq-train"
                    for call in ast.walk(func) for kw in getattr(call, "keywords", ())):
                other |= set(ast.walk(func))
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "add_argument") or call in other:
                continue
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            names = [a.value if isinstance(a, ast.Constant) else None for a in call.args]
            dest = next((kw.value.value for kw in call.keywords if kw.arg == "dest"
                         and isinstance(kw.value, ast.Constant)), None)
            if dest is None and names and None not in names:
                long = [n for n in names if n.startswith("--")] or names
                dest = long[0].lstrip("-").replace("-", "_")
            yield where, dest


@pytest.mark.parametrize("argv", [TOY, ["--task", "bert"]], ids=["toy", "bert"])
def test_a_flag_is_declared_once_as_a_field_of_its_section(argv):
    """Every flag of the job's and the node's configuration (the task's own
    aside) is declared by exactly one ``flag(...)`` field of a section
    (sections.py), and no add_argument call of the training command in
    hetseq/ declares it again: the parser is built from the sections."""
    args, job, node = cli.parse(list(map(str, argv)))
    users = {field.name for _, cls in EXCHANGES.items() if not cls.__module__.startswith("hetseq.")
             for field in dataclasses.fields(cls.Config)}   # a --user-dir mode of another test
    dests = (set(job.flags()) | set(node.flags())) - set(cli.task_dests(TASKS.get(args.task)))
    dests -= users
    declared = collections.Counter(field.name for cls in set(_sections())
                                   for field in sections.flag_fields(cls))
    assert {dest: declared[dest] for dest in dests if declared[dest] != 1} == {}
    assert set(declared) == dests         # and no flag field outside the two configurations
    calls = list(_add_argument_calls())
    assert {where.split(":")[0] for where, dest in calls if dest is None} == {"hetseq/base/sections.py"}
    assert [(where, dest) for where, dest in calls if dest in dests] == []


def test_the_identity_is_the_job_config_and_leaves_the_node_out():
    _, job, node = cli.parse([*TOY, "--seed", "3", "--max-sentences", "8"])
    identity = job.identity()
    assert identity["seed"] == 3 and "max_sentences" not in identity
    # Every flag of the job, but those of the exchange modes it does not run
    # (at their defaults: tests/system/test_exchange_modes.py).
    assert set(identity) - {"hetseq_version", "hetseq_code", "user_code"} == \
        set(job.flags()) - set(job.exchange.unused())
    assert "local_steps" in job.flags() and "local_steps" not in identity
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
