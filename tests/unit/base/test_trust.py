"""Code that another user can plant never runs (issue 58, item 1), and the
launcher's own faults end in one line (item 7): a shared launch folder,
--remote-dir, hostfile or --user-dir is refused with its owner and mode;
no wrapper or probe imports from its working folder; --compile keeps its
pickled code in a private folder; a probe's answer of any shape is a
problem line; a paused launcher never stops its nodes; a peer's words
reach the terminal without escapes; a number flag is finite.

Everything runs as root here and in CI, so "another user" is uid 65534
(nobody), given the files, and the modes under test are set by hand."""

import json
import os
import sys
import time

import pytest
import torch

from hetseq.distributed import identity
from hetseq.base.errors import UserError
from hetseq.launch import hostfile
from hetseq.base.owned_file import compile_cache, others_can_change, refuse_unless_owned
from hetseq.tasks import import_user_dir


NOBODY = 65534


PLANTED = "import pathlib; pathlib.Path({marker!r}).write_text('ran')\n"


def folder(path, mode=0o700, owner=None):
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def plant(where, marker, name="json.py", owner=NOBODY):
    """A module another user drops into ``where``: it leaves ``marker`` if it runs."""
    planted = where / name
    planted.write_text(PLANTED.format(marker=str(marker)))
    os.chown(planted, owner, owner)
    return planted


def test_a_path_is_refused_when_it_or_a_folder_above_it_is_not_yours(tmp_path):
    mine = folder(tmp_path / "mine")
    assert others_can_change(mine) is None
    # Under a sticky folder that others may write (as /tmp): only the owner
    # of a name may rename it there, so a folder of yours inside is yours.
    sticky = folder(tmp_path / "sticky", 0o1777)
    assert others_can_change(folder(sticky / "job")) is None
    assert "others may write it" in others_can_change(sticky)
    # Without the sticky bit anyone may replace what is inside.
    loose = folder(tmp_path / "loose", 0o777)
    inner = folder(loose / "job")
    assert f"others may write in it and replace {inner}" in others_can_change(inner)
    assert "mode 777" in others_can_change(inner)
    theirs = folder(tmp_path / "theirs", 0o755, owner=NOBODY)
    why = others_can_change(theirs)
    assert "owner nobody (uid 65534): its owner could change it" in why
    group = folder(tmp_path / "group", 0o775)
    assert "mode 775" in others_can_change(group)
    # A link is judged by what it points to.
    (mine / "link").symlink_to(loose)
    assert "mode 777" in others_can_change(mine / "link")
    with pytest.raises(UserError, match=r"--hostfile .*mode 777.* mkdir -m 700 ") as err:
        refuse_unless_owned(loose, "--hostfile")
    assert "chmod" not in str(err.value)       # never advised on a folder not the user's


def test_a_hostfile_another_user_can_change_is_refused(tmp_path):
    # A link kept in a folder others may write can be pointed elsewhere
    # after the check: the folders on the way as written are judged too.
    mine = folder(tmp_path / "mine")
    (mine / "hosts").write_text("localhost slots=1 cpu\n")
    loose = folder(tmp_path / "loose", 0o777)
    (loose / "hosts").symlink_to(mine / "hosts")
    with pytest.raises(UserError, match=r"mode 777.*others may write in it"):
        hostfile.read(str(loose / "hosts"))
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1 cpu user-dir=/their/folder\n")
    os.chmod(hosts, 0o666)
    with pytest.raises(UserError, match=rf"--hostfile {hosts}: .*mode 666.*others may write it"):
        hostfile.read(str(hosts))
    os.chmod(hosts, 0o644)
    os.chown(hosts, NOBODY, NOBODY)
    with pytest.raises(UserError, match=r"owner nobody \(uid 65534\): its owner could change"):
        hostfile.read(str(hosts))
    os.chown(hosts, 0, 0)
    assert hostfile.read(str(hosts))[0].slots == 1


def test_a_user_dir_another_user_can_change_is_refused_before_it_is_imported(tmp_path):
    marker = tmp_path / "planted-ran"
    mine = folder(tmp_path / "mine")
    tasks = folder(mine / "trusttasks_a")
    plant(tasks, marker, name="__init__.py", owner=0)
    os.chmod(tasks, 0o777)
    with pytest.raises(UserError, match=r"--user-dir .*mode 777"):
        import_user_dir(str(tasks))
    os.chmod(tasks, 0o755)
    os.chown(tasks / "__init__.py", NOBODY, NOBODY)
    with pytest.raises(UserError, match=r"--user-dir's module .*__init__\.py.*uid 65534"):
        import_user_dir(str(tasks))
    # A folder behind a link is walked: Python imports through it.
    os.chmod(tasks / "__init__.py", 0o644)
    os.chown(tasks / "__init__.py", 0, 0)
    loose = folder(tmp_path / "loose", 0o777)
    (tasks / "sub").symlink_to(loose)
    with pytest.raises(UserError, match=r"--user-dir's folder .*mode 777"):
        import_user_dir(str(tasks))
    # Its parent goes first on sys.path: a shared parent is refused too.
    shared = folder(tmp_path / "shared", 0o1777)
    other = folder(shared / "trusttasks_b")
    (other / "__init__.py").write_text("")
    with pytest.raises(UserError, match=r"its parent folder \(on the module path\)"):
        import_user_dir(str(other))
    assert not marker.exists()
    assert "trusttasks_a" not in sys.modules and "trusttasks_b" not in sys.modules


def test_compile_keeps_its_code_in_a_private_folder(tmp_path, monkeypatch):
    """torch's default /tmp/torchinductor_USER can be made first by another
    user; --compile uses a persistent folder of the user's own instead."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder(tmp_path / "cache")))
    path = compile_cache()
    assert path == str(tmp_path / "cache" / "hetseq" / "inductor")
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
    assert compile_cache() == path               # the same folder next time: no recompiling
    squatted = folder(tmp_path / "squatted", 0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(squatted))
    with pytest.raises(UserError, match=r"TORCHINDUCTOR_CACHE_DIR .*mode 777"):
        compile_cache()


def test_a_peers_words_reach_the_terminal_printable_and_of_any_shape():
    """The identity and its founder are written into the store by a peer
    (any peer, in a job without a secret): a refusal shows them without
    escape sequences, and an identity that is no object is named."""
    class Store(dict):
        def compare_set(self, key, expected, value):
            return self.setdefault(key, value.encode() if isinstance(value, str) else value)

        def check(self, keys):
            return all(k in self for k in keys)

        def get(self, key):
            return self[key]

    for held, differ in ((json.dumps({"seed": "\x1b[31m1"}).encode(), r"--seed 2 here, '\\x1b\[31m1'"),
                         (b"[1, 2]", "of another form"), (b"\xff\xfe{", "of another form"),
                         (b"[" * 100_000, "of another form")):
        store = Store({"hetseq/job": held, "hetseq/job-by": b"host\x1b]0;x\x07 pid 1"})
        with pytest.raises(UserError, match=differ) as err:
            identity.present(store, {"seed": 2}, 1, "tcp://a:1", "me", time.monotonic() + 5)
        assert "\x1b" not in str(err.value) and "(started by host?]0;x? pid 1)" in str(err.value)


def test_adam_betas_must_be_numbers_below_one():
    from types import SimpleNamespace
    from hetseq.optim import AdamW
    params = [torch.zeros(2, requires_grad=True)]
    for betas in ("(nan, 0.999)", "(1.5, 0.999)", "(0.9, inf)"):
        cfg = SimpleNamespace(adam_betas=betas, adam_eps=1e-8, weight_decay=0.0)
        with pytest.raises(UserError, match=r"--adam-betas .*from 0 up to \(not including\) 1"):
            AdamW.build(cfg, params, 0.1)


@pytest.mark.parametrize("flag", ["--max-memory-gb", "--lr", "--clip-norm"])
def test_a_number_flag_that_is_not_finite_is_refused(flag):
    from hetseq.app import cli
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit) as err:
            cli.parse(["--task", "bert", flag, value])
        assert err.value.code == 2
