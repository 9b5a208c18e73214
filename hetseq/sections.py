"""Deprecated name of hetseq.base.sections, kept so that old imports (and old
installs' console scripts) work: this name is that module itself."""

import sys
import warnings

from hetseq.base import sections as _module

warnings.warn(
    "hetseq.sections is deprecated: import hetseq.base.sections",
    DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
