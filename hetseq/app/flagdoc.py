"""docs/flags.md, written from the parser itself so that it cannot fall
behind: ``python -m hetseq.app.flagdoc > docs/flags.md`` (tests/unit/project/test_docs.py
checks that the file is what this prints).

Every flag of ``--help``, group by group, then the flags each built-in task
adds and the defaults each task sets for general flags.
"""

import argparse

from hetseq.app import cli
from hetseq.app.config import NO_EFFECT
from hetseq.tasks import TASKS, import_builtin_tasks
from hetseq.update import modes

HEADER = """\
# Every flag

Written by `python -m hetseq.app.flagdoc > docs/flags.md` from the parser, so it
matches `python train.py --task NAME --help`. Flags are the **job's** (every
node must pass the same value; nodes that differ are refused at start-up,
naming the flag) unless marked **node**: those may differ per node
([design.md](design.md#two-configurations-the-jobs-and-the-nodes)). The
topic pages explain when to use which: [nodes](nodes.md),
[capacity](capacity.md), [memory and precision](memory-and-precision.md),
[checkpoints](checkpoints.md), [elastic](elastic.md),
[slow links](slow-links.md), [BERT](bert.md), [tasks](tasks.md).
"""


def _cell(text):
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def _default(action):
    if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
        return ""
    return f"`{_plain(action.default)}`"


def _rows(actions, node_flags):
    rows = []
    for action in actions:
        if not action.option_strings or action.dest == "help":
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.metavar:
            names += f" {action.metavar}"
        kind = "node" if action.dest in node_flags else "job"
        if action.dest in NO_EFFECT:
            kind = "-"
        help_text = (action.help or "") % {"default": action.default} if action.help else ""
        choices = f" Choices: {', '.join(map(str, action.choices))}." if action.choices else ""
        rows.append(f"| {names} | {kind} | {_default(action)} | {_cell(help_text)}{choices} |")
    return rows


def _table(title, actions, node_flags):
    rows = _rows(actions, node_flags)
    if not rows:
        return []
    return [f"## {title}", "", "| flag | whose | default | meaning |", "|---|---|---|---|",
            *rows, ""]


def _node_flags():
    from hetseq.app import config
    args = cli.parse_args(["--task", "bert"])
    _, node = config.build(args)
    return config.per_node_flags(node) | {"user_dir", "data", "num_workers"}


def markdown():
    import_builtin_tasks()
    node_flags = _node_flags()
    parser = cli.build_parser()
    lines = [HEADER]
    for group in parser._action_groups:
        if group.title.startswith(modes.USER_GROUP):
            continue        # a --user-dir's mode (a process may have imported one)
        title = "General" if group.title in ("options", "optional arguments") else group.title
        lines += _table(title, group._group_actions, node_flags)
    # The built-in tasks only (a process may have imported user tasks too).
    for name in sorted(n for n in TASKS.names() if TASKS.get(n).__module__.startswith("hetseq.")):
        task_cls = TASKS.get(name)
        task_parser = cli.build_parser(task_cls)
        group = next(g for g in task_parser._action_groups if g.title == f"Task '{name}'")
        lines += _table(f"Task '{name}': its own flags", group._group_actions,
                        node_flags | set(task_cls.per_node_flags))
        if task_cls.defaults:
            lines += [f"Defaults `--task {name}` sets for general flags: " + ", ".join(
                f"`--{dest.replace('_', '-')} {_plain(value)}`"
                for dest, value in sorted(task_cls.defaults.items())) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def _plain(value):
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return value


if __name__ == "__main__":
    print(markdown(), end="")
