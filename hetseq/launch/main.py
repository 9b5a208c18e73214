"""Deprecated name of hetseq.launch.launcher, kept so that old imports (and old
installs' console scripts) work: this name is that module itself."""

import sys
import warnings

from hetseq.launch import launcher as _module

warnings.warn(
    "hetseq.launch.main is deprecated: import hetseq.launch.launcher",
    DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
