"""Deprecated name of hetseq.base.errors, kept so that old imports (and old
installs' console scripts) work: this name is that module itself."""

import sys
import warnings

from hetseq.base import errors as _module

warnings.warn(
    "hetseq.errors is deprecated: import hetseq.base.errors",
    DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
