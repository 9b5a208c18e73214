import pytest


from machinery.commands import run_train
from unit.tasks.test_registry import PLAIN_TASK


@pytest.mark.parametrize("world", [1, 2])
def test_plain_user_dir_trains_with_one_and_two_processes(tmp_path, world):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "demo_task.py").write_text(PLAIN_TASK)
    result = run_train("--task", "plain_demo", "--user-dir", folder, "--max-sentences", 4,
                       "--max-update", 3, "--lr", 0.01, "--distributed-world-size", world,
                       "--save-dir", tmp_path / "ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: reached --max-update 3" in result.stderr


def test_a_task_with_the_old_one_argument_constructor_still_runs(tmp_path):
    folder = tmp_path / "oldstyle"
    folder.mkdir()
    (folder / "task.py").write_text(PLAIN_TASK.replace("plain_demo", "old_style").replace(
        "class PlainDemo(Task):\n",
        "class PlainDemo(Task):\n    def __init__(self, args):\n        super().__init__(args)\n"))
    result = run_train("--task", "old_style", "--user-dir", folder, "--max-sentences", 4,
                       "--max-update", 2, "--no-save")
    assert result.returncode == 0, result.stderr[-3000:]
