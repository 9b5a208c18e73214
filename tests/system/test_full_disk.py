"""A disk that fills while a job trains (issue 58, item 4): every file a run
writes for people (balance.jsonl, valid.jsonl, TensorBoard, hetseq-plot's
picture) stops with one line naming the file and the disk, and training goes
on; a checkpoint the disk refuses ends the run in one line naming the

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/base/test_full_disk.py."""

import errno
import logging
import os
import re
import types

import pytest
import torch

from machinery.commands import start_nodes
from machinery.settings import TOY, require_module
from machinery.watched import Watched
from hetseq.distributed.spawn import DistContext
from hetseq.base.errors import UserError
from hetseq.reporting import plot
from hetseq.reporting.balance import BalanceLog, ValidLog
from hetseq.reporting.tensorboard import TensorBoard
from hetseq.run.loop import Run
from unit.base.test_full_disk import Part, checkpointer


PAGE = 4096


def fill(disk, leave=0):
    """Take every byte left on ``disk`` but ``leave`` (rounded to pages)."""
    path = disk / "filler"
    with open(path, "ab", buffering=0) as filler:
        try:
            while filler.write(b"\0" * PAGE):
                pass
        except OSError:
            pass
        filler.truncate(max(0, filler.tell() - leave))
    return path


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def said_once(lines, start, disk):
    """The one line among ``lines`` that starts with ``start``: it names the
    reason and the disk."""
    found = [line for line in lines if line.startswith(start)]
    assert len(found) == 1, lines
    assert re.search(rf"\(No space left on device; the disk mounted at {re.escape(str(disk))} "
                     r"\(\d+ bytes of 256\.0 KiB free\)\); training goes on without it$",
                     found[0]), found[0]


def test_the_balance_and_validation_logs_stop_once_and_keep_whole_lines(small_disk, caplog):
    balance, valid = BalanceLog(str(small_disk), True), ValidLog(str(small_disk), True)

    def record(update):
        balance.record(update, [8, 4], 12, 0.01, [0.01, 0.02], [8, 4], loss=1.5, lr=0.1)
    record(1)
    record(2)                           # update 1's line: the file has its first page
    fill(small_disk)
    caplog.set_level(logging.WARNING)
    for update in range(3, 100):        # a page holds about 15 lines: the page runs out
        record(update)
    valid.record(10, 1, "valid", {"loss": 0.5})     # a new file on a full disk
    valid.record(20, 1, "valid", {"loss": 0.4})
    balance.close()
    valid.close()
    lines = warnings(caplog)
    assert len(lines) == 2, lines
    said_once(lines, f"the balance log: cannot write to {small_disk}/balance.jsonl ", small_disk)
    said_once(lines, f"the validation log: cannot write to {small_disk}/valid.jsonl ", small_disk)
    # Whole lines only: the line that met the full disk was cut off.
    kept = [line["update"] for line in plot.read_lines(balance.path)]
    assert kept == list(range(1, len(kept) + 1)) and 2 < len(kept) < 98, kept
    # Stopped: with room again, nothing more is written.
    os.remove(small_disk / "filler")
    size = os.path.getsize(balance.path)
    record(100)
    record(101)
    balance.close()
    assert os.path.getsize(balance.path) == size
    assert len(warnings(caplog)) == 2


def test_tensorboard_stops_once_when_the_disk_fills(small_disk, caplog):
    require_module("tensorboard")
    busy = TensorBoard(str(small_disk / "busy"), True)
    busy.log("train", {"loss": 1.0}, 1)
    fill(small_disk)
    caplog.set_level(logging.WARNING)
    for step in range(2, 400):          # past its page: its writer thread fails
        busy.log("train", {"loss": 1.0, "lr": 0.1, "samples_per_s": 10.0}, step)
    busy.close()
    assert busy.logdir is None and len(warnings(caplog)) == 1
    # A writer whose last events fail only as it closes (a race with its
    # thread, so a stand-in here) is said once too.
    last = TensorBoard(str(small_disk / "last"), True)
    last._writers["train"] = types.SimpleNamespace(
        close=lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    last.close()
    last.close()
    lines = warnings(caplog)
    assert len(lines) == 2, lines
    for name in ("busy", "last"):
        said_once(lines, f"TensorBoard: cannot write to {small_disk}/{name} ", small_disk)


def saved_updates(path):
    return torch.load(path, weights_only=True)["controller"]["num_updates"]


def test_a_save_the_full_disk_refuses_names_the_disk_and_the_checkpoint_that_resumes(small_disk):
    part = Part()
    saver = checkpointer(small_disk, part)
    last = small_disk / "checkpoint_last.pt"
    part.updates = 2
    saver.save(2, 1)
    fill(small_disk)
    part.updates = 5
    refusal = (f"no space left on device while writing {last}; the previous checkpoint {last} is "
               "intact; it resumes from update 2; training stops at update 5. Free space on the "
               f"disk mounted at {small_disk} (")
    with pytest.raises(UserError) as this_run:
        saver.save(5, 1)
    assert str(this_run.value).startswith(refusal), this_run.value
    assert str(this_run.value).endswith("then run the same command again to resume")
    # A run that resumed and has not saved yet reads the count from the file.
    with pytest.raises(UserError) as resumed:
        checkpointer(small_disk, part).save(5, 1)
    assert str(resumed.value).startswith(refusal), resumed.value
    assert saved_updates(last) == 2
    assert sorted(p.name for p in small_disk.iterdir()) == ["checkpoint_last.pt", "filler"]


def test_a_copy_the_full_disk_refuses_names_the_new_last_checkpoint(small_disk):
    # checkpoint_last.pt fits, the epoch copy fits, checkpoint_best.pt does not.
    part = Part()
    saver = checkpointer(small_disk, part)
    last = small_disk / "checkpoint_last.pt"
    saver.save(1, 1)
    size = -(-os.path.getsize(last) // PAGE) * PAGE
    fill(small_disk, leave=size * 3 // 2)
    part.updates = 3
    with pytest.raises(UserError) as refused:
        saver.save(3, 1, epoch=1, metric=0.5)
    best = small_disk / "checkpoint_best.pt"
    assert str(refused.value).startswith(
        f"no space left on device while writing {best}; there was no earlier checkpoint of that "
        f"name; {last} holds update 3 and resumes it; training stops at update 3. Free space on "
        f"the disk mounted at {small_disk} ("), refused.value
    assert saved_updates(last) == 3 and not best.exists()


def test_the_picture_on_a_full_disk_is_one_line_and_the_previous_one_stays(small_disk, capsys,
                                                                          monkeypatch):
    require_module("matplotlib")
    from matplotlib.figure import Figure
    # A tiny figure for the run's: what is tested is its file (drawing costs seconds).
    monkeypatch.setattr(plot, "figure", lambda save_dir: Figure(figsize=(1, 1)))
    (small_disk / "run.png").write_bytes(b"the previous picture")
    fill(small_disk)
    with pytest.raises(SystemExit) as ended:
        plot.main([str(small_disk)])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hetseq-plot: error: cannot write {small_disk}/run.png (No space "
                          f"left on device; the disk mounted at {small_disk} ("), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (small_disk / "run.png").read_bytes() == b"the previous picture"
    assert not (small_disk / ".run.png.partial").exists()


def test_an_export_the_full_disk_refuses_is_one_line(small_disk):
    model = torch.nn.Linear(200, 200)       # 160 KB: more than the disk has left

    def export_hf(exported, folder):
        torch.save(exported.state_dict(), os.path.join(folder, "pytorch_model.bin"))
    folder = str(small_disk)
    run = types.SimpleNamespace(
        ctx=DistContext(0, 1, 0, torch.device("cpu")),
        checkpointer=types.SimpleNamespace(has_best=lambda: False),
        controller=types.SimpleNamespace(full_model_state=model.state_dict),
        task=types.SimpleNamespace(build_model=lambda: torch.nn.Linear(200, 200),
                                   export_hf=export_hf),
        job=types.SimpleNamespace(checkpoint=types.SimpleNamespace(export_hf=folder)),
        node=types.SimpleNamespace(save=types.SimpleNamespace(no_save=False, save_dir="ckpt")))
    fill(small_disk)
    with pytest.raises(UserError, match=re.escape(
            f"--export-hf: cannot write {folder} (the write failed; the disk mounted at "
            f"{small_disk} (")):
        Run.export(run)


def test_a_disk_that_fills_between_checkpoints(small_disk, tmp_path):
    """The toy job saves at update 25 and waits at its 26th step; the disk
    fills; it trains on to update 50 (its balance lines meet the full disk
    after at most a page, its validation at 40 too), then its save fails:
    exit 2, one line naming the disk and checkpoint_last.pt of update 25."""
    go = tmp_path / "go"
    node = Watched(start_nodes([[
        *TOY, "--max-sentences", 8, "--max-update", 60, "--save-dir", small_disk,
        "--save-interval-updates", 25, "--keep-interval-updates", 0, "--save-interval", 1000,
        "--validate-interval", 1000, "--validate-interval-updates", 40,
        "--toy-hold-until", go, "--toy-hold-from", 26]])[0])
    last = small_disk / "checkpoint_last.pt"
    node.wait_for(re.escape(f"saved {last} (25 updates)"))
    fill(small_disk)
    go.touch()
    code, out = node.finish(timeout=120)
    assert code == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert re.search(r"\| update 49\b", out), out[-3000:]          # training went on
    lines = out.strip().splitlines()
    assert lines[-1].endswith(
        f" | ERROR | hetseq.run | no space left on device while writing {last}; the previous "
        f"checkpoint {last} is intact; it resumes from update 25; training stops at update 50. Free space on the "
        f"disk mounted at {small_disk} (0 bytes of 256.0 KiB free) or pass --save-dir on a "
        "larger disk, then run the same command again to resume"), lines[-1]
    for writer in (f"the balance log: cannot write to {small_disk}/balance.jsonl",
                   f"the validation log: cannot write to {small_disk}/valid.jsonl",
                   f"TensorBoard: cannot write to {small_disk}/tensorboard"):
        assert out.count(writer) == 1, out[-3000:]
    assert saved_updates(last) == 25
    kept = [line["update"] for line in plot.read_lines(str(small_disk / "balance.jsonl"))]
    assert kept == list(range(1, len(kept) + 1)) and 25 <= len(kept) < 48, kept
