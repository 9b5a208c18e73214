"""Deprecated name of hetseq.app.main, kept so that old imports (and old
installs' console scripts, ``python -m``) work: this name is that module
itself, and run as a program it runs that module's main."""

import sys
import warnings

from hetseq.app import main as _module

warnings.warn(
    "hetseq.main is deprecated: import hetseq.app.main",
    DeprecationWarning, stacklevel=2)
if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
