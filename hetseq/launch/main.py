"""Deprecated name of hetseq.launch.launcher, kept so that old imports (and old
installs' console scripts, ``python -m``) work: this name is that module
itself, and run as a program it runs that module's main."""

import sys
import warnings

from hetseq.launch import launcher as _module

warnings.warn(
    "hetseq.launch.main is deprecated: import hetseq.launch.launcher",
    DeprecationWarning, stacklevel=2)
if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
