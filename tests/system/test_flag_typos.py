"""Every command answers a misspelt flag alike (hetseq/base/flags.py): one line
that names the typo and the nearest flag, exit 2, no usage and no
traceback; a hostfile's keys too.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/base/test_flag_typos.py."""

import subprocess
import sys


from machinery.settings import ROOT
from hetseq.launch import launcher as launch
from unit.base.test_flag_typos import refused
from unit.base.test_flag_typos import hosts  # noqa: F401,F811  (fixtures)


def test_hetseq_launch_names_a_misspelt_flag_even_the_required_one(capsys, hosts):
    # argparse alone says only "the following arguments are required: --hostfile".
    err = refused(capsys, launch.main, ["--hostfiel", hosts, "train.py", "--lr", "1"])
    assert err == ("hetseq-launch: error: unknown flag --hostfiel: did you mean --hostfile? "
                   "(all flags: --help)\n")
    err = refused(capsys, launch.main, ["--hostfile", hosts, "--dryrun", "train.py"])
    assert "unknown flag --dryrun: did you mean --dry-run?" in err
    err = refused(capsys, launch.main, ["--hostfile", hosts, "--laucher", "local", "train.py"])
    assert "unknown flag --laucher: did you mean --launcher?" in err
    # No typo: argparse's own message stays.
    err = refused(capsys, launch.main, ["train.py"])
    assert "the following arguments are required: --hostfile" in err


def test_hetseq_launch_leaves_the_scripts_flags_to_the_script(capsys, hosts):
    args = launch.build_parser().parse_args(["--hostfile", hosts, "train.py", "--dryrun", "-x"])
    assert args.script == "train.py" and args.args == ["--dryrun", "-x"]
    assert capsys.readouterr().err == ""


def test_the_installed_command_answers_without_a_traceback(hosts):
    done = subprocess.run([sys.executable, "-m", "hetseq.launch", "--hostfiel", hosts,
                           "train.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("hetseq-launch: error: unknown flag --hostfiel: did you mean "
                           "--hostfile? (all flags: --help)\n")


def test_the_train_command_names_itself_as_it_was_run(tmp_path):
    """A typo in ``python train.py`` is train.py's error, one in hetseq-train
    (python -m hetseq.app.main) hetseq-train's; a misspelt task is answered
    with the nearest one."""
    typo = ["--task", "toy", "--user-dir", str(ROOT / "tests" / "tasks"), "--max-updat", "3"]
    for command, name in (([str(ROOT / "train.py")], "train.py"),
                          (["-m", "hetseq.app.main"], "hetseq-train")):
        done = subprocess.run([sys.executable, *command, *typo], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and done.stderr == (
            f"{name}: error: unknown flag --max-updat: did you mean --max-update? "
            "(all flags: --help)\n"), done.stderr
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--task", "bret"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown task 'bret' (did you mean 'bert'?)" in done.stderr
    assert "Traceback" not in done.stderr
