"""Keyed randomness: draws that belong to the sample, not the rank
(randomness.py), the modules that use them (nn.py), and the kernels that
draw them on either path (kernels/).
Layer 2: imports base. Tests: tests/unit/keyed/, tests/system/."""
