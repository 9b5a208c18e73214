"""HetSeq: synchronous data-parallel training on heterogeneous infrastructure."""

import os
import sys

__version__ = "0.2.0"

# c10d's C++ layer logs each failed store call with a full C++ stack dump,
# printed before HetSeq's own message that names the lost rank and the fix.
# torch reads this variable once, when it loads: HetSeq's entry points import
# this package first, so they start quiet; a value you set yourself (WARNING,
# INFO) wins, and a program that imported torch before HetSeq is left alone.
if "torch" not in sys.modules:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
