"""Honest time left (progress lines and hetseq-status): "measuring" until
there is a rate, validations and saves counted at what they took, never
0:00:00 before the end; a line where each validation and save starts and
ends; each node's lines carry its own ranks from the first line on.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/reporting/test_time_left.py."""

import re

from machinery.commands import node_commands, run_nodes, run_train
from machinery.settings import TOY


def test_a_run_marks_its_validations_and_saves_and_counts_them_in_the_time_left(tmp_path):
    result = run_train(*TOY, "--optimizer", "sgd", "--lr", "0.1", "--max-update", 8,
                       "--log-interval", 1, "--max-sentences", 8, "--save-dir", tmp_path,
                       "--validate-interval-updates", 3, "--save-interval-updates", 3,
                       "--no-epoch-checkpoints")
    out = result.stderr
    assert result.returncode == 0, out[-3000:]
    lines = [line.split(" | ", 4)[-1] for line in out.splitlines()
             if "hetseq.run |" in line or "hetseq.progress |" in line]
    heads = [re.search(r"update (\d+)/8 \| ([^|]+) \|", line) for line in lines]
    left = {int(m[1]): m[2].strip() for m in heads if m}
    assert left[1] == "measuring time left", left
    # Before the first validation and save too: a time, their estimates in
    # it; never zero before the end (update 8 validates and saves).
    assert all(re.fullmatch(r"\d+:\d\d:\d\d left", left[u]) for u in range(2, 9)), left
    assert "0:00:00 left" not in out
    for update in (3, 6, 8):
        start = lines.index(f"validating 'valid' ({_valid_size(out)} samples)...",
                            lines.index(next(l for l in lines if f"update {update}/8 |" in l)))
        assert re.fullmatch(r"validated in \d+\.\d s", lines[start + 2]), lines[start:start + 3]
        assert f"| update {update}" in lines[start + 1]          # the result between them
        save = lines.index(f"saving a checkpoint of update {update}...", start)
        assert re.fullmatch(r"saved in \d+\.\d s", lines[save + 1]), lines[save:save + 2]


def _valid_size(out):
    return re.search(r"validating 'valid' \((\d+) samples\)", out)[1]


def test_every_line_of_a_node_says_its_own_ranks(tmp_path):
    """Node 2's first line (the demo corpus it will read, logged before its
    ranks start) said 'rank 0'; every line of a node names its ranks."""
    from hetseq.bert import demo
    from hetseq.bert.model import BertConfig
    default = demo.pretraining_data()
    with open(default.vocab) as f:
        vocab_size = sum(1 for _ in f)
    config = tmp_path / "tiny.json"
    BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=128).to_json(config)
    common = ["--task", "bert", "--config_file", config, "--max-update", 1, "--no-save",
              "--disable-validation", "--max_pred_length", 20]
    results = run_nodes(node_commands(common, [(1, ["--max-sentences", 4]),
                                               (2, ["--max-sentences", 2])]))
    for (code, out), ranks in zip(results, ("0", "1-2")):
        assert code == 0, out[-3000:]
        said = re.findall(r"^\d\d:\d\d:\d\d \| (rank [\d-]+|node) \|", out, re.M)
        assert said and said[0] == f"rank {ranks}", said
        line = next(line for line in out.splitlines() if "no --data: pretraining" in line)
        assert f"| rank {ranks} |" in line, line
        # Then its ranks' own lines: rank 1's and rank 2's on node 2.
        own = {f"rank {ranks}", *(f"rank {r}" for r in ranks.split("-"))}
        assert set(said) <= own, said
