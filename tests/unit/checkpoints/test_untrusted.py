"""Bytes from a file or a peer are data, never code: a checkpoint or a
collective's payload that carries a pickled call is refused (exit 2 for a
checkpoint), and the call never runs. Both are read with
``torch.load(weights_only=True)`` (hetseq/checkpoints/files.py,
hetseq/distributed/collectives.py); these tests keep them so."""

import io
import os

import pytest
import torch

from hetseq.distributed import collectives


class Planted:
    """Unpickling this makes the folder ``path``: a visible side effect."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_payload_from_a_peer_carrying_code_is_refused_and_the_code_never_runs(tmp_path):
    marker = tmp_path / "the-code-ran"
    buffer = io.BytesIO()
    torch.save({"state": Planted(marker)}, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        collectives._decode(payload)
    assert not marker.exists()
    assert collectives._decode(collectives._encode({"n": 3})) == {"n": 3}   # data still reads
