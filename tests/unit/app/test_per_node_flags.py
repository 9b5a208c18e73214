"""A node's own flags never change what the ranks do together.

Every per-node flag (NodeConfig, config.py) is set to different values on
the two ranks of a job, one flag at a time and all at once, under every
--zero mode, with and without clipping. Each rank's collectives are recorded
(tests/machinery/recording.py): both ranks must issue the same ones, in the
same order and sizes, update by update, and the weights must equal one
process training on the same global batch. Were a per-node flag to reach the
update path, the ranks would pair different collectives: a hang, an error,
or wrong numbers (as --tensorboard-logdir on one node did under --zero 2/3
with --clip-norm 0: one rank measured the sharded norm, one more all-reduce).
"""

import dataclasses


from hetseq.app import cli, config

from machinery.settings import TOY


# Rank 0's and rank 1's value of each per-node flag the Run sees (None: not
# given; True/False: a switch). The launch flags decide which process is
# which rank before the Run starts, and cannot differ inside one process
# pair; the task's own per-node flags are the task's promise.
VARIED = {
    "max_sentences": (16, 8),
    "max_sentences_valid": (4, 7),
    "capacity_weight": (1, 3),
    "micro_batch_cap": (0, 3),
    "max_memory_gb": (None, 0.5),
    "num_workers": (0, 1),
    "data": (None, "{dir}"),
    "save_dir": ("{dir}/node0", "{dir}/node1"),
    "restore_file": (None, "elsewhere.pt"),
    "no_save": (False, True),
    "log_interval": (1, 1000),
    "log_format": ("tqdm", "json"),
    "log_all_ranks": (False, True),
    "no_progress_bar": (False, True),
    "tensorboard_logdir": ("{dir}/tb", None),
    "no_tensorboard": (True, False),
}


NOT_IN_A_RUN = {f.name for f in dataclasses.fields(config.LaunchConfig)} | {"user_dir"}


def test_the_varied_flags_are_every_per_node_flag():
    _, _, node = cli.parse(list(map(str, TOY)))
    task_flags = {name for name, _ in node.task_flags}
    assert set(VARIED) | NOT_IN_A_RUN == config.per_node_flags(node) - task_flags
