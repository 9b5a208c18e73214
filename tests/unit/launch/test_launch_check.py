"""Several nodes tried on one machine and checked before a launch: the
README's one-machine line runs (hetseq-launch --launcher local), an SSH
failure on this machine names the local way, ``hetseq-launch --check``
prints one table and exits 2 with the fix for a host that cannot run its
part, and a launch refuses a line whose GPUs are not there."""

import re

from hetseq.launch import check


def test_the_check_judges_versions_and_devices():
    """Two hosts on different code or torch are told so; a GPU line is fine
    where torch sees the GPUs."""
    base = {"hetseq": "0.2.0", "code": "a" * 16, "torch": "2.13.0", "memory": 8e9,
            "interface": "eth0 10.0.0.1", "cuda": []}
    answers = [check.Answer("nodeA", "nodeA", 1, 2, 2, {**base, "cuda": [{"name": "X",
                                                                           "free": 4e9}] * 2}),
               check.Answer("nodeB", "nodeB", 2, 1, 0, {**base, "code": "b" * 16,
                                                        "torch": "2.11.0"})]
    check.judge(answers)
    assert answers[0].problems == []
    (code, fix), (torch_what, _) = answers[1].problems
    assert "HetSeq code digest bbbbbbbbbbbbbbbb, but nodeA has aaaaaaaaaaaaaaaa" in code
    assert fix == "install the same HetSeq commit on every host"
    assert torch_what == "torch 2.11.0, but nodeA has 2.13.0"
    rows = check.table(answers)
    assert re.match(r"nodeA\s+2 GPU\s+2 GPU\s+8\.0 GB \+ GPU 4\.0 GB, 4\.0 GB\s+eth0 10\.0\.0\.1",
                    rows[1]), rows
