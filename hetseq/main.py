"""Deprecated name of hetseq.app.main, kept so that old imports (and old
installs' console scripts) work: this name is that module itself."""

import sys
import warnings

from hetseq.app import main as _module

warnings.warn(
    "hetseq.main is deprecated: import hetseq.app.main",
    DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
