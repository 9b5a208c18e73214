"""Every command answers a misspelt flag alike (hetseq/base/flags.py): one line
that names the typo and the nearest flag, exit 2, no usage and no
traceback; a hostfile's keys too."""


import pytest

from hetseq.app import cli
from hetseq.base import flags
from hetseq.base.errors import UserError
from hetseq.launch import hostfile
from hetseq.reporting import plot, status
from hetseq.store import secret


def refused(capsys, main, argv):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert "Traceback" not in err and "usage:" not in err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("localhost slots=1 cpu\n")
    return str(path)


def test_hetseq_status_names_a_misspelt_flag(capsys):
    err = refused(capsys, status.main, ["--jsn", "tcp://127.0.0.1:1"])
    assert err.startswith("hetseq-status: error: unknown flag --jsn: did you mean --json?")
    err = refused(capsys, status.main, ["--wacth"])        # the URL missing too
    assert "unknown flag --wacth: did you mean --watch?" in err


def test_hetseq_plot_names_a_misspelt_flag(capsys, tmp_path):
    err = refused(capsys, plot.main, ["--otu", str(tmp_path / "x.png"), str(tmp_path)])
    assert err.startswith("hetseq-plot: error: unknown flag --otu: did you mean --out?")


def test_hetseq_secret_names_a_misspelt_flag(capsys, tmp_path):
    err = refused(capsys, secret.main, ["--fiel", str(tmp_path / "s")])
    assert err.startswith("hetseq-secret: error: unknown flag --fiel: did you mean --file?")
    assert not (tmp_path / "s").exists()


def test_one_implementation_and_abbreviations_refused(capsys):
    assert cli.Parser is flags.Parser
    err = refused(capsys, status.main, ["--js", "tcp://127.0.0.1:1"])   # not --json
    assert "unknown flag --js" in err


def test_a_misspelt_hostfile_key_is_named_with_its_line():
    with pytest.raises(UserError, match=r"^hosts line 2: unknown key slot=2: did you mean "
                                        r"slots=2\?$"):
        hostfile.parse("# lab\nnodeA slot=2 cpu\n", "hosts")
    with pytest.raises(UserError, match=r"line 1: unknown key slts: did you mean slots\?"):
        hostfile.parse("nodeA slts\n", "hosts")
    with pytest.raises(UserError, match="nodeA has no slots=N"):      # nothing near: as before
        hostfile.parse("nodeA cpu\n", "hosts")
