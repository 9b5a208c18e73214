import pytest

from hetseq.app import cli
from hetseq.base.errors import UserError
from hetseq.base.registry import Registry
from hetseq.tasks import TASKS, Task, import_builtin_tasks, import_user_dir, register_task

from machinery.settings import ROOT, TOY


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


def test_a_misspelt_task_is_answered_with_the_nearest_one():
    """--task bret: 'did you mean bert', as a misspelt flag is answered; a
    name near none of them lists what exists only."""
    import_builtin_tasks()
    with pytest.raises(UserError, match=r"unknown task 'bret' \(did you mean 'bert'\?\); "
                                        r"registered tasks: .*glue"):
        cli.parse_args(["--task", "bret"])
    with pytest.raises(UserError) as err:
        TASKS.get("nope")
    assert "did you mean" not in str(err.value)


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


PLAIN_TASK = """
import torch
from hetseq.tasks import Task, register_task


@register_task("plain_demo")
class PlainDemo(Task):
    def load_dataset(self, split):
        x = torch.arange(16.0).view(16, 1)
        return torch.utils.data.TensorDataset(x, 2 * x)

    def build_model(self):
        return torch.nn.Linear(1, 1)

    def loss(self, model, sample):
        x, y = sample
        return ((model(x) - y) ** 2).sum(), len(x), {}
"""


def test_user_dir_without_init_imported_twice_in_one_process(tmp_path):
    """The launcher and the rank import --user-dir in the same process when
    there is one rank: the folder's own earlier import is no clash."""
    folder = tmp_path / "plainagain"
    folder.mkdir()
    (folder / "mine.py").write_text(PLAIN_TASK.replace("plain_demo", "plain_again"))
    import_user_dir(folder)
    import_user_dir(folder)
    assert "plain_again" in TASKS
    other = tmp_path / "elsewhere" / "plainagain"
    other.mkdir(parents=True)
    with pytest.raises(UserError, match="a different module named 'plainagain'"):
        import_user_dir(other)


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


def test_task_defaults_apply_and_flags_override():
    glue = cli.parse_args(["--task", "glue"])
    assert (glue.lr, glue.max_sentences, glue.warmup_ratio, glue.max_epoch, glue.clip_norm,
            glue.keep_last_epochs) == ([5e-5], 32, 0.1, 3, 1.0, 0)
    bert = cli.parse_args(["--task", "bert"])
    assert (bert.lr, bert.max_sentences) == ([1e-4], 32)
    given = cli.parse_args(["--task", "glue", "--lr", "1e-3", "--max-sentences", "4",
                            "--save-dir", "elsewhere"])
    assert (given.lr, given.max_sentences, given.save_dir) == ([1e-3], 4, "elsewhere")
    toy = cli.parse_args(TOY)   # a task without defaults keeps the general ones
    assert toy.lr == [0.25] and toy.max_sentences is None and toy.keep_last_epochs == -1


def test_every_task_saves_to_checkpoints_slash_its_name_unless_told():
    """GLUE's folder is named for its model too: a run from other weights
    never resumes another model's checkpoints."""
    for argv, where in ((["--task", "glue"], "checkpoints/glue-minilm"),
                        (["--task", "glue", "--load-hf-weights", "checkpoints/bert"],
                         "checkpoints/glue-bert"),
                        (["--task", "bert"], "checkpoints/bert"), (TOY, "checkpoints/toy"),
                        (["--task", "bert", "--save-dir", "x"], "x")):
        _, _, node = cli.parse(list(map(str, argv)))
        assert node.save.save_dir == where
        assert node.log.tensorboard_logdir == f"{where}/tensorboard"


def test_task_defaults_show_in_help():
    text = " ".join(cli.build_parser(TASKS.get("glue")).format_help().split())
    assert "(default: [5e-05])" in text and "(default: checkpoints/<task>; glue's named for " \
        "its model too)" in text
    text = " ".join(cli.build_parser(TASKS.get("bert")).format_help().split())
    assert "(default: [0.0001])" in text and "--max-sentences N" in text


def test_task_defaults_must_name_real_options():
    class Broken(Task):
        registered_name = "broken"
        defaults = {"learning_rate": 1.0}

    with pytest.raises(ValueError, match="unknown options \\['learning_rate'\\]"):
        cli.build_parser(Broken)


def test_best_metric_direction_follows_the_metric():
    def maximize(*flags):
        return cli.parse([*TOY, *flags])[1].checkpoint.maximize_best_checkpoint_metric
    assert maximize("--best-checkpoint-metric", "f1")
    assert not maximize()                                 # loss: smaller is better
    assert not maximize("--best-checkpoint-metric", "f1", "--maximize-best-checkpoint-metric") \
        is False


def test_a_plugin_flag_that_is_taken_is_one_line_naming_it():
    """A task (or exchange mode) declaring a flag HetSeq has: a UserError
    naming the plugin and the flag, not argparse's traceback."""
    class Clash(Task):
        registered_name = "clash"

        @classmethod
        def add_args(cls, parser):
            parser.add_argument("--zero", type=int)
    with pytest.raises(UserError, match=r"task 'clash' declares a flag that is already taken "
                                        r"\(argument --zero: conflicting option string: --zero\)"):
        cli.build_parser(Clash)
