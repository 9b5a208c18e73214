"""Deprecated name of hetseq.keyed.randomness, kept so that old imports (and old
installs' console scripts) work: this name is that module itself."""

import sys
import warnings

from hetseq.keyed import randomness as _module

warnings.warn(
    "hetseq.randomness is deprecated: import hetseq.keyed.randomness",
    DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
