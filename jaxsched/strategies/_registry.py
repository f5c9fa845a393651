"""The strategy registry: names to strategy classes, duplicates refused.

Example:
    >>> "dear" in strategy_names()
    True
    >>> make_strategy("wfbp").name
    'wfbp'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from jaxsched._errors import JaxschedTypeError, JaxschedValueError
from jaxsched.sim._costmodel import register_comm_pattern, unregister_comm_pattern

if TYPE_CHECKING:  # the registry is imported by base's strategies; base imports it back
    from jaxsched.runtime.collectives._base import Collective
    from jaxsched.strategies._base import Strategy

__all__ = ["make_strategy", "register_strategy", "STRATEGIES", "strategy_names", "StrategyNames", "unregister_strategy"]

_STRATEGIES: dict[str, type[Strategy]] = {}

_S = TypeVar("_S", bound=type)


def register_strategy(cls: _S) -> _S:
    """Register a [`Strategy`][jaxsched.strategies.Strategy] subclass under ``cls.name`` (a class decorator).

    Its ``cost`` becomes known to the planners and the simulator under the same name.

    Args:
      cls: a [`Strategy`][jaxsched.strategies.Strategy] subclass whose class attribute ``name`` is
        non-empty and not yet taken.

    Returns:
      ``cls`` itself.

    Raises:
      JaxschedTypeError: ``cls`` is not a [`Strategy`][jaxsched.strategies.Strategy] subclass.
      JaxschedValueError: its ``name`` is empty or already registered.

    Example:
        >>> from jaxsched.strategies import Wfbp
        >>> @register_strategy
        ... class EagerWfbp(Wfbp):
        ...     name = "eager-wfbp"
        >>> make_strategy("eager-wfbp").name, "eager-wfbp" in STRATEGIES
        ('eager-wfbp', True)
        >>> unregister_strategy("eager-wfbp")
    """
    from jaxsched.strategies._base import Strategy

    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise JaxschedTypeError(f"register_strategy needs a Strategy subclass, got {cls!r}")
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise JaxschedValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    if name in _STRATEGIES:
        raise JaxschedValueError(
            f"a strategy named {name!r} is already registered ({_STRATEGIES[name].__qualname__}); choose another name"
        )
    register_comm_pattern(name, cls.cost)
    _STRATEGIES[name] = cls
    return cls


def unregister_strategy(name: str) -> None:
    """Remove a registered strategy (and its cost pattern); for tests and plugins.

    Args:
      name: the strategy's registered name; an unknown name is ignored.

    Example:
        >>> from jaxsched.strategies import AllReduce
        >>> _ = register_strategy(type("Plain", (AllReduce,), {"name": "plain"}))
        >>> unregister_strategy("plain")
        >>> "plain" in STRATEGIES
        False
    """
    if _STRATEGIES.pop(name, None) is not None:
        unregister_comm_pattern(name)


def strategy_names() -> tuple[str, ...]:
    """The registered strategies' names, in registration order (built-ins first).

    Returns:
      A tuple of names, each valid as ``jaxsched.schedule(step, strategy=name)``.

    Example:
        >>> strategy_names()[:3]
        ('allreduce', 'wfbp', 'dear')
    """
    return tuple(_STRATEGIES)


def make_strategy(strategy: str | Strategy, collective: Collective | None = None, **options: object) -> Strategy:
    """A strategy instance from a registered name, or an instance as given.

    Args:
      strategy: a registered name, or a [`Strategy`][jaxsched.strategies.Strategy] instance (returned as it is).
      collective: for a name, the [`Collective`][jaxsched.runtime.collectives.Collective] the strategy sends
        its buckets with.
      **options: for a name, the strategy constructor's keyword options.

    Returns:
      The [`Strategy`][jaxsched.strategies.Strategy] instance.

    Raises:
      JaxschedValueError: an unknown name.
      JaxschedTypeError: a class instead of an instance, or options with an instance.

    Example:
        >>> make_strategy("dear").name
        'dear'
    """
    from jaxsched.strategies._base import Strategy

    if isinstance(strategy, Strategy):
        if options or collective is not None:
            given = sorted(options) + (["collective"] if collective is not None else [])
            raise JaxschedTypeError(
                f"options {given} go to the strategy's constructor when a Strategy instance ({strategy!r}) is passed"
            )
        return strategy
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        raise JaxschedTypeError(f"pass an instance ({strategy.__name__}()) or a registered name, not the class")
    if strategy not in _STRATEGIES:
        raise JaxschedValueError(f"strategy={strategy!r} is unknown; choose one of {', '.join(_STRATEGIES)}")
    if collective is not None:
        options["collective"] = collective
    factory: Callable[..., Strategy] = _STRATEGIES[strategy]  # each subclass takes its own options
    return factory(**options)


class StrategyNames(Sequence):
    """A live, read-only view of the registered names (``"dear" in STRATEGIES``)."""

    def __getitem__(self, i):
        return strategy_names()[i]

    def __len__(self) -> int:
        return len(_STRATEGIES)

    def __contains__(self, name: object) -> bool:
        return name in _STRATEGIES

    def __repr__(self) -> str:
        return repr(strategy_names())


STRATEGIES = StrategyNames()
