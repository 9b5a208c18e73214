import pytest

from hetseq import cli
from hetseq.errors import UserError
from hetseq.registry import Registry
from hetseq.tasks import TASKS, Task, import_user_dir, register_task

from conftest import ROOT, TOY


def test_duplicate_name_is_rejected():
    registry = Registry("thing", base=Task)

    @registry.register("a")
    class A(Task):
        pass

    with pytest.raises(ValueError, match="'a' is already registered"):
        @registry.register("a")
        class B(Task):
            pass


def test_non_task_class_is_rejected():
    with pytest.raises(TypeError, match="subclass of Task"):
        @register_task("not_a_task")
        class NotATask:
            pass
    assert "not_a_task" not in TASKS


def test_unknown_name_lists_registered():
    import_user_dir(ROOT / "tests" / "tasks")
    with pytest.raises(UserError) as err:
        TASKS.get("nope")
    assert "unknown task 'nope'" in str(err.value) and "toy" in str(err.value)


def test_unknown_task_on_command_line():
    with pytest.raises(UserError, match="registered tasks: .*toy"):
        cli.parse_args(["--task", "nope", "--user-dir", str(ROOT / "tests" / "tasks")])


def test_user_dir_without_init_imports_modules(tmp_path):
    folder = tmp_path / "plainfolder"
    folder.mkdir()
    (folder / "mine.py").write_text(
        "from hetseq.tasks import Task, register_task\n"
        "@register_task('plain_folder_task')\nclass T(Task):\n    pass\n")
    import_user_dir(folder)
    assert "plain_folder_task" in TASKS


def test_missing_user_dir_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        import_user_dir(tmp_path / "missing")


def test_task_flags_and_aliases_parse():
    args = cli.parse_args([*TOY, "--toy-size", "7", "--optimizer", "adam",
                           "--lr_scheduler", "PolynomialDecayScheduler", "--adam-betas",
                           "(0.9, 0.98)", "--fast-stat-sync", "--lr", "0.5,0.1",
                           "--update-freq", "2,1", "--local_rank", "0"])
    assert args.toy_size == 7 and args.lr == [0.5, 0.1] and args.update_freq == [2, 1]


@pytest.mark.parametrize("flags, words", [
    (["--optimizer", "lion"], ["unknown optimizer 'lion'", "adamw"]),
    (["--lr-scheduler", "step"], ["unknown LR scheduler 'step'", "polynomial_decay"]),
    (["--max-tokens", "4096"], ["--max-tokens 4096", "--max-sentences"]),
    (["--max-sentences", "0"], ["--max-sentences 0"]),
    (["--update-freq", "0"], ["--update-freq"]),
])
def test_bad_training_flags(flags, words):
    with pytest.raises(UserError) as err:
        cli.parse_args([*TOY, *flags])
    for word in words:
        assert word in str(err.value)
