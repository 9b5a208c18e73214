"""The exchange modes (update/exchange.py), and which one a job runs.

Each mode is a module of this package that registers it (outer.py and
compress.py serve local steps and PowerSGD); a ``--user-dir`` module may
register more. A job runs ``--exchange NAME``; without it, the mode whose own
flags ask for it, else synchronous. The job's ExchangeConfig (below) holds the
name and every registered mode's flags. Modes import update's core and zero/,
never the Controller. Tests: tests/unit/update/, tests/system/test_exchange_modes.py.
"""

import dataclasses
import importlib
import pkgutil

from hetseq.base.errors import UserError
from hetseq.base.sections import Section, flag, frozen, section
from hetseq.update.exchange import EXCHANGES

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

DEFAULT = "synchronous"
TITLE = "Exchange modes: synchronous, local steps (DiLoCo), PowerSGD"
# A --user-dir mode's flags come in a group of their own, titled so: the
# flags page (flagdoc.py) and its test leave them out.
USER_GROUP = "Exchange mode '"


def _builtin(cls):
    return cls.__module__.startswith(__name__ + ".")


@section
class ExchangeConfig(Section):
    """How ranks exchange what they learned: the exchange mode and the flags
    of every registered mode (each mode's declared in its own Config). Built
    by ``configure``, which knows the modes."""
    exchange: str = flag(None, metavar="NAME", help=lambda: (
        "how ranks exchange what they learned: "
        f"{', '.join(name for name, cls in EXCHANGES.items() if _builtin(cls))}, or a mode "
        "of --user-dir (default: the one its flags ask for, --local-steps H or "
        "--grad-compression powersgd, else synchronous)"))
    mode_flags: tuple = ()        # (dest, value) of every registered mode's flags
    # The dests of the chosen mode's own flags: the others are at their
    # defaults (check_args refuses them otherwise), and a mode that only
    # one node's --user-dir registers must not make the nodes differ.
    own: tuple = ()

    @classmethod
    def from_args(cls, args):
        raise TypeError("the ExchangeConfig is built by hetseq.update.modes.configure(args)")

    def flags(self):
        return {"exchange": self.exchange, **dict(self.mode_flags)}

    def unused(self):
        """The dests of the flags of the modes the job does not run."""
        return [dest for dest, _ in self.mode_flags if dest not in self.own]


def add_args(parser):
    """--exchange, and every registered mode's flags: the built-in modes'
    in one group, each of a user's in a group of its own."""
    group = parser.add_argument_group(TITLE)
    ExchangeConfig.add_args(group)
    for name, cls in EXCHANGES.items():
        cls.add_args(group if _builtin(cls) else
                     parser.add_argument_group(f"{USER_GROUP}{name}'"))


def chosen(args):
    """The mode's name: --exchange, else the first whose flags ask for it."""
    if args.exchange is not None:
        EXCHANGES.get(args.exchange)          # an unknown name lists the registered ones
        return args.exchange
    return next((name for name, cls in EXCHANGES.items() if cls.asks(args)), DEFAULT)


def check_args(args, defaults):
    """Each mode's refusals (in the order of their names), then flags that
    ask for a mode other than the one chosen."""
    name = chosen(args)
    for other, cls in EXCHANGES.items():
        cls.check_args(args, defaults, chosen=other == name)
    asking = [f"{asked} asks for exchange mode '{other}'" for other, cls in EXCHANGES.items()
              if other != name and (asked := cls.asks(args))]
    if asking:
        raise UserError(f"{'; '.join(asking)}, not --exchange {name}: leave out one of them")


def configure(args):
    """The job's ExchangeConfig: the mode's name and every mode's flags."""
    flags = {field.name: frozen(getattr(args, field.name))
             for _, cls in EXCHANGES.items() for field in dataclasses.fields(cls.Config)}
    name = chosen(args)
    own = tuple(field.name for field in dataclasses.fields(EXCHANGES.get(name).Config))
    return ExchangeConfig(exchange=name, mode_flags=tuple(sorted(flags.items())), own=own)


def build(cfg, precision_cfg, ctx, rewindable=False):
    """This run's mode (``cfg``: the job's ExchangeConfig; ``rewindable``:
    --elastic) with its own section of the flags."""
    cls = EXCHANGES.get(cfg.exchange)
    flags = dict(cfg.mode_flags)
    own = cls.Config(**{field.name: flags[field.name] for field in dataclasses.fields(cls.Config)})
    return cls(own, precision_cfg, ctx, rewindable)
