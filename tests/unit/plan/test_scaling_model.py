"""The scaling model of bench/scaling.py: fits recover known links, the
overlap rule, and the link solve (its measurements need root: not run here)."""

import importlib.util

import pytest
from torch import nn

from machinery.settings import ROOT

spec = importlib.util.spec_from_file_location("scaling", ROOT / "bench" / "scaling.py")
scaling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scaling)


def test_ring_fit_recovers_bandwidth_and_latency():
    bandwidth, latency = 50e6, 0.004                      # bytes/s, s
    runs = [{"rate": "1gbit", "hosts": hosts, "all_reduce": [
        [size, scaling.ring_factor(hosts) * size / bandwidth + latency]
        for size in (2**20, 2**22, 2**24)]} for hosts in (2, 3)]
    link = scaling.fit_link(runs, "1gbit")
    assert link["bandwidth_Bps"] == pytest.approx(bandwidth, rel=1e-9)
    assert link["latency_s"] == pytest.approx(latency, abs=1e-12)
    assert link["of_nominal"] == pytest.approx(0.4)      # 400 Mbit/s of 1 Gbit/s


def test_last_bucket_is_the_first_parameters():
    # Reverse order: 4 KiB (first bucket, cap 1 MiB, not full), 4 MiB closes it;
    # the first layer's 1 MiB is left for the last bucket.
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(1024, 1024, bias=False),
                          nn.Linear(32, 32, bias=False))
    sizes = [512 * 512 * 4, 1024 * 1024 * 4, 32 * 32 * 4]
    assert scaling.tail_fraction(model, bucket_cap_mb=8) == pytest.approx(sizes[0] / sum(sizes))


def test_overlap_hides_at_most_the_backward_and_never_the_tail():
    assert scaling.update_s(1.0, 0.6, comm=0.2, eta=1.0, tail=0.25) == pytest.approx(1.05)
    assert scaling.update_s(1.0, 0.6, comm=2.0, eta=0.5, tail=0.25) == pytest.approx(2.7)


def test_update_freq_and_bandwidth_raise_efficiency_and_the_solve_hits_its_target():
    spec = {"bytes": 440e6, "tail": 0.2, "eta": 0.7, "link_eff": 0.9, "latency": 1e-3, "gpus": 4}
    one, four = (scaling.efficiency(spec, 10e9, 8, freq, 0.65) for freq in (1, 4))
    assert 0 < one < four < 1
    assert scaling.efficiency(spec, 25e9, 8, 1, 0.65) > one
    assert scaling.efficiency(spec, 10e9, 1, 1, 0.65) == 1.0      # one node: the baseline
    link = scaling.needed_link(spec, 0.9, 8, 1, 0.65)
    assert scaling.efficiency(spec, link, 8, 1, 0.65) == pytest.approx(0.9, abs=1e-6)
