"""Training objectives by name: ``loss.type`` picks one, the step receives it.

An objective is an object with three calls per optimizer window (``Objective``): ``begin`` (fresh
sums), ``microbatch`` (this microbatch's share of the window objective, a scalar to backward; the
model is run here, through ``outputs``), ``end`` (the window's metrics, reduced over the ranks that
hold distinct tokens). Normalisation is always the window's (``data.global_loss_tokens`` /
``global_loss_sequences``), never a microbatch's, so no plan changes the gradient.

A new objective is one file in this package with one class under ``@register_loss("name")`` (and
the name added to ``loss.type``'s allowed values in ``config/validate.py``): ``build_loss`` imports
every module of the package once, so registration needs no list kept elsewhere.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import ClassVar

LOSSES: dict[str, type[Objective]] = {}


class Objective:
    """One training objective over optimizer windows; ``cfg`` is the ``loss.*`` section (or None)."""

    name: ClassVar[str]

    def __init__(self, cfg=None):
        self.cfg = cfg

    def begin(self, data, env) -> None:
        """Start a window (``data``: its StepData): reset the sums."""
        raise NotImplementedError

    def microbatch(self, model, mb, data, env):
        """This microbatch's share of the window objective (a scalar tensor to backward)."""
        raise NotImplementedError

    def end(self, env) -> dict[str, float]:
        """The window's ``loss`` and metrics, every rank the same (a collective)."""
        raise NotImplementedError


def registrar(table: dict, what: str):
    """A class decorator factory filling ``table`` by name (objectives here, advantage estimators
    in ``backend.rl.advantages``); a name taken by another class is refused."""

    def register(name: str):
        def wrap(cls):
            if name in table and table[name] is not cls:
                raise ValueError(f"{what} {name!r} is registered twice ({table[name].__name__}, {cls.__name__})")
            cls.name = name
            table[name] = cls
            return cls

        return wrap

    return register


#: Class decorator: ``loss.type: name`` builds this objective.
register_loss = registrar(LOSSES, "loss")


def _discover() -> None:
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{module.name}")


def loss_names() -> list[str]:
    """Every registered objective's name."""
    _discover()
    return sorted(LOSSES)


def build_loss(cfg) -> Objective:
    """The objective ``cfg.type`` names (``cfg`` None: cross-entropy, the default)."""
    name = "cross_entropy" if cfg is None else cfg.type
    if name not in LOSSES:
        _discover()
    if name not in LOSSES:
        raise ValueError(f"loss.type={name!r}: allowed values are {', '.join(sorted(LOSSES))}")
    return LOSSES[name](cfg)
