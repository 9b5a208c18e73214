"""Nodes must agree on the job: a node whose flags differ is refused before it
claims a rank, with the flags named; the job that was there first goes on."""

import os

import hetseq
from hetseq.app import cli, digests
from hetseq.distributed import identity

from machinery.settings import ROOT, TOY


def toy_identity(*argv):
    _, job, _ = cli.parse([*map(str, TOY), *map(str, argv)])
    return job.identity()


def test_per_node_flags_are_left_out():
    base = toy_identity("--max-sentences", 8, "--save-dir", "x", "--toy-slow-rank", 1)
    other = toy_identity("--max-sentences", 64, "--save-dir", "y", "--toy-slow-rank", 0,
                         "--num-workers", 2, "--log-interval", 5, "--cpu")
    assert base == other
    assert "hetseq_code" in base and "seed" in base and "max_sentences" not in base
    changed = toy_identity("--seed", 2, "--max-epoch", 3)
    assert identity.differences(changed, base) == \
        "--max-epoch 3 here, 0 in the job; --seed 2 here, 19940802 in the job"


def test_files_compare_by_content_and_folders_are_left_out(tmp_path):
    # Each node may keep its copy of a config or vocab elsewhere.
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text('{"hidden": 4}')

    def bert_identity(folder):
        return toy_identity("--task", "bert", "--config_file", tmp_path / folder / "config.json",
                            "--load-hf-weights", tmp_path / folder)
    ids = [bert_identity(f) for f in ("a", "b")]
    assert ids[0] == ids[1] and ids[0]["config_file"].startswith("sha256:")
    assert "load_hf_weights" not in ids[0]       # a folder: each node's own
    (tmp_path / "b" / "config.json").write_text('{"hidden": 8}')
    digests._DIGESTS.clear()
    assert bert_identity("b")["config_file"] != ids[0]["config_file"]


def test_a_user_dirs_code_is_part_of_the_job_wherever_it_lies(tmp_path):
    """A task or exchange mode in --user-dir decides the update: nodes whose
    copies differ are told so; the same files in another folder agree."""
    import shutil
    tasks = str(ROOT / "tests" / "tasks")
    copies = [shutil.copytree(tasks, tmp_path / name) for name in ("a", "b")]
    base = toy_identity()                       # TOY's --user-dir is tests/tasks
    assert [digests.source_digest(copy, every_file=True) for copy in copies] == \
        [base.get("user_code")] * 2
    with open(copies[1] / "toy.py", "a") as source:
        source.write("\n# another loss here\n")
    changed = {**base, "user_code": digests.source_digest(copies[1], every_file=True)}
    assert identity.differences(changed, base).startswith(
        "the --user-dir's code (the same files on every node) ")
    _, job, _ = cli.parse(["--task", "bert"])                  # no --user-dir: no code
    assert "user_code" not in job.identity()


def test_nodes_on_different_code_are_told_so():
    base = toy_identity()
    other = {**base, "hetseq_code": "0123456789abcdef"}
    text = identity.differences(other, base)
    assert text.startswith("HetSeq's code (install the same version on every node) "
                           "'0123456789abcdef' here"), text


def test_the_code_digest_counts_what_decides_the_update_only(tmp_path):
    """Nodes whose test helpers, plot or status view differ still meet; a
    node whose update code differs does not (issue 49)."""
    import shutil
    copy = tmp_path / "hetseq"
    shutil.copytree(os.path.dirname(hetseq.__file__), copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = digests.source_digest(str(copy))
    import machinery         # the test helpers: not under hetseq/, so never hashed
    library = os.path.dirname(os.path.realpath(hetseq.__file__))
    assert not os.path.realpath(machinery.__file__).startswith(library + os.sep)
    for helper in ("reporting/plot.py", "reporting/status.py", "app/flagdoc.py"):
        with open(copy / helper, "a") as f:
            f.write("\n# another node's copy\n")
    assert digests.source_digest(str(copy)) == before
    with open(copy / "update" / "controller.py", "a") as f:
        f.write("\n# another update\n")
    assert digests.source_digest(str(copy)) != before
