"""The one base class of every error jaxsched raises, so that callers can catch them all.

Each error also derives from the built-in class a caller would otherwise expect
(`ValueError` for a bad value, `TypeError` for a bad type), so ``except ValueError``
keeps working.

Example:
    >>> import jaxsched
    >>> try:
    ...     jaxsched.network_preset("10gbe", workers=0)
    ... except jaxsched.JaxschedError as error:
    ...     print(type(error).__name__)
    ProfileError
"""

from __future__ import annotations

__all__ = [
    "JaxschedError",
    "JaxschedRuntimeError",
    "JaxschedTypeError",
    "JaxschedValueError",
    "JaxschedWarning",
    "UnshardedStepWarning",
]


class JaxschedError(Exception):
    """Base class of every error jaxsched raises.

    Example:
        >>> import jaxsched
        >>> try:
        ...     jaxsched.schedule(lambda p, o, b: (p, o, {}), strategy="nonsense")
        ... except jaxsched.JaxschedError as error:
        ...     print(isinstance(error, ValueError))
        True
    """


class JaxschedValueError(JaxschedError, ValueError):
    """A value jaxsched cannot use: a bad argument, step or configuration.

    Example:
        >>> import jaxsched
        >>> issubclass(jaxsched.JaxschedValueError, (jaxsched.JaxschedError, ValueError))
        True
    """


class JaxschedTypeError(JaxschedError, TypeError):
    """An argument or step output of a type jaxsched cannot use.

    Example:
        >>> import jaxsched
        >>> issubclass(jaxsched.JaxschedTypeError, TypeError)
        True
    """


class JaxschedRuntimeError(JaxschedError, RuntimeError):
    """A failure while running: a peer, a process or a device did not do what was expected.

    Example:
        >>> import jaxsched
        >>> issubclass(jaxsched.JaxschedRuntimeError, RuntimeError)
        True
    """


class JaxschedWarning(UserWarning):
    """Base class of every warning jaxsched gives, so that a filter can name them all.

    Example:
        >>> import warnings
        >>> import jaxsched
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", jaxsched.JaxschedWarning)  # each one raises
        ...     try:
        ...         warnings.warn("no input is sharded", jaxsched.UnshardedStepWarning)
        ...     except jaxsched.JaxschedWarning as caught:
        ...         print(type(caught).__name__)
        UnshardedStepWarning
    """


class UnshardedStepWarning(JaxschedWarning):
    """A step runs on one device of several: no input is sharded over a mesh, so nothing is
    parallelised or scheduled (the batch was most likely left as numpy arrays).

    Example:
        >>> import jaxsched
        >>> issubclass(jaxsched.UnshardedStepWarning, jaxsched.JaxschedWarning)
        True
    """


# tracebacks and reprs name the public path (``jaxsched.JaxschedValueError``)
for _cls in (JaxschedError, JaxschedValueError, JaxschedTypeError, JaxschedRuntimeError, JaxschedWarning,
             UnshardedStepWarning):  # fmt: skip
    _cls.__module__ = "jaxsched"
del _cls
