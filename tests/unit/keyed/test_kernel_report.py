"""bench/kernel_report.py: the keyed kernels, compiled on this CPU for an
sm_80 and an sm_90 card exactly as a BERT-base call specializes them (and
every other tile the runtime may pick), meet issue 57's goals read from
their SASS; and the reader finds what it claims to."""

import sys

from machinery.settings import ROOT


sys.path.insert(0, str(ROOT / "bench"))


import kernel_report  # noqa: E402


SASS = [(0x00, "MOV", ""), (0x10, "IMAD", ""), (0x20, "LOP3", ""),        # the loop
        (0x30, "BRA", " 0x10"), (0x40, "FMUL", ""), (0x50, "HMMA", ""),  # a bigger one
        (0x60, "MUFU.EX2", ""), (0x70, "BRA", " 0x40"), (0x80, "EXIT", ""),
        (0x90, "BRA", " 0x90")]                                          # a BRA to itself


def test_the_hottest_loop_is_the_largest_innermost_one_never_the_trailing_branch():
    body, looped = kernel_report.hottest_loop(SASS)
    assert looped and [address for address, _, _ in body] == [0x40, 0x50, 0x60, 0x70]
    nested = SASS[:8] + [(0x80, "BRA", " 0x00")]      # an outer loop around both
    assert kernel_report.hottest_loop(nested)[0] == body
    straight = [i for i in SASS if i[1] != "BRA"]
    assert kernel_report.hottest_loop(straight) == (straight, False)
