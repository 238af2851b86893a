"""The value checks the cost model's classes share: a finite number above
(or at) 0, a count of at least 1. Standard library only."""
import math

__all__ = ['require_positive', 'require_count']


def require_positive(name: str, value, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number > 0 (or
    >= 0)."""
    ok = (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        and math.isfinite(value) and (value >= 0 if allow_zero else value > 0))
    if not ok:
        rule = 'a number >= 0' if allow_zero else 'a number > 0'
        raise ValueError(f'{name} should be {rule}, but got {value!r}')


def require_count(name: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} should be an int >= 1, but got {value!r}')
