"""Ranks stay equal to rank 0 for runs of any length: rounding apart is undone,
a real divergence stops the run (hetseq/update/agreement.py)."""


import torch

from hetseq.update.agreement import _buckets, checksum, disagreeing


def test_checksum_is_exact_order_sensitive_and_dtype_blind():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, generator=g), torch.randn(3, 5, generator=g, dtype=torch.float64)
    base = checksum([a, b])
    assert base == checksum([a.clone(), b.clone()]) and base > 0
    nudged = a.clone()
    nudged[17] = torch.nextafter(nudged[17], torch.tensor(10.0))    # one unit in the last place
    assert checksum([nudged, b]) != base
    assert checksum([b, a]) != base                                 # the order counts
    assert checksum([a.bfloat16(), torch.ones(4, dtype=torch.bool)]) > 0
    assert checksum([]) == 0.0
    assert disagreeing([5.0, 5.0, 6.0]) == [2] and disagreeing([0.0, 0.0]) == []


def test_ranks_split_their_state_alike_whatever_device_holds_it():
    """A GPU rank keeps Adam's step counts on the host, a CPU rank all of its
    state: both must make the same broadcasts in a resync, or it hangs (seen
    on an H200 with a CPU rank). Here "meta" stands in for the GPU."""
    shapes = [(4, 3), (), (4, 3), (), (5,)]
    on_host = [torch.zeros(shape) for shape in shapes]
    mixed = [torch.zeros(shape, device="meta" if shape else "cpu") for shape in shapes]

    def sizes(tensors):
        return [sum(t.numel() for t in bucket) for bucket in _buckets(tensors, limit=20)]
    assert sizes(mixed) == sizes(on_host) == [13, 18]
