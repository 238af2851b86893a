"""Checks of config values, worded alike everywhere.

Standard library only, so that the torch-only hook modules and the pure
Python tools use the same wording as the MMEngine glue: ``<name> should be
<rule>, but got <value>``, a ``TypeError`` for a wrong type and a
``ValueError`` for a value out of range.
"""
import math
import numbers
from typing import Any, Callable, Optional

__all__ = ['with_args_check', 'require_int', 'require_real', 'require_bool']


def with_args_check(check: Callable[[dict], None]) -> Callable:
    """Attach a check of the config values to a state factory.

    :func:`~mmcv_custom.comm.builder.check_comm_hook_cfg` calls
    ``check(args)`` before anything is built and without a process group,
    on every run (distributed or not). ``args`` holds every argument of the
    factory except ``process_group``: the config's value, or the factory's
    default where the config has none (a factory taking ``**kwargs`` gets
    just the config's keys). The check raises ``TypeError`` for a wrong type
    and ``ValueError`` for a value out of range, saying what is valid and
    what it got; the checker puts ``comm_hook <type>: `` in front, so one
    factory can serve several names. :func:`require_int`,
    :func:`require_real` and :func:`require_bool` word such errors.

    The check is kept as the factory's ``check_args`` attribute, which may
    also be set directly. Factories without one are built unchecked.

    Args:
        check (Callable): ``check(args: dict) -> None``.

    Returns:
        Callable: A decorator that returns the factory itself.

    Example:
        >>> def _check(args):
        ...     require_int('every', args['every'], minimum=1)
        >>> @COMM_HOOK_STATES.register_module(name='my_hook')
        ... @with_args_check(_check)
        ... def my_state(process_group, every=1):
        ...     return dict(group=process_group, every=every)
    """
    if not callable(check):
        raise TypeError('with_args_check needs a callable check(args), but '
                        f'got {type(check).__name__}: {check!r}')

    def attach(factory: Callable) -> Callable:
        factory.check_args = check
        return factory

    return attach


def _got(value: Any) -> str:
    """How a wrongly typed value is named: its type, then its repr."""
    return f'{type(value).__name__}: {value!r}'


def require_int(name: str,
                value: Any,
                minimum: Optional[int] = None,
                maximum: Optional[int] = None) -> None:
    """Raise unless ``value`` is an int within ``[minimum, maximum]``.

    ``bool`` does not count as an int (``True`` is no rank). Integers of
    other libraries (numpy's) do.

    Raises:
        TypeError: not an int, e.g. ``matrix_approximation_rank should be
            an int >= 1, but got str: 'two'``.
        ValueError: out of range, e.g. ``... should be an int >= 1, but got
            0``.
    """
    if minimum is not None and maximum is not None:
        rule = f'an int in [{minimum}, {maximum}]'
    elif minimum is not None:
        rule = f'an int >= {minimum}'
    elif maximum is not None:
        rule = f'an int <= {maximum}'
    else:
        rule = 'an int'
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f'{name} should be {rule}, but got {_got(value)}')
    if ((minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        raise ValueError(f'{name} should be {rule}, but got {value!r}')


def require_real(name: str,
                 value: Any,
                 minimum: Optional[float] = None,
                 inclusive: bool = True,
                 allow_none: bool = False) -> None:
    """Raise unless ``value`` is a finite real number above ``minimum``.

    Args:
        name (str): The key, for the message.
        value: The value to check. ``bool`` is not a number here.
        minimum (float, optional): The lower bound. Defaults to None.
        inclusive (bool): Whether ``minimum`` itself is allowed. Defaults to
            True.
        allow_none (bool): Whether None is allowed. Defaults to False.

    Raises:
        TypeError: not a real number, e.g. ``min_compression_rate should be
            a finite real number > 0, but got str: 'two'``.
        ValueError: out of range, inf or NaN.
    """
    rule = 'a finite real number'
    if minimum is not None:
        rule += f" {'>=' if inclusive else '>'} {minimum}"
    if allow_none:
        rule = 'None or ' + rule
        if value is None:
            return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f'{name} should be {rule}, but got {_got(value)}')
    if not math.isfinite(value) or (minimum is not None and
                                    (value < minimum or
                                     (not inclusive and value == minimum))):
        raise ValueError(f'{name} should be {rule}, but got {value!r}')


def require_bool(name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is True or False (a truthy
    string such as ``'no'`` is neither)."""
    if not isinstance(value, bool):
        raise TypeError(
            f'{name} should be True or False, but got {_got(value)}')
