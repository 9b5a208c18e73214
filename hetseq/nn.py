"""Deprecated name of hetseq.keyed.nn, kept so that old imports (and old
installs' console scripts) work: this name is that module itself."""

import sys
import warnings

from hetseq.keyed import nn as _module

warnings.warn(
    "hetseq.nn is deprecated: import hetseq.keyed.nn",
    DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
