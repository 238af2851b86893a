"""The hooks the analysis tools compare: every hook registered in
:data:`~mmcv_custom.comm.registry.COMM_HOOKS`, with its record.

The tools read their lists of hooks, labels and colours from here, not
from tables of their own, so that a hook registered with a record (a
plugin's too) shows in each of them; one registered without a record
shows under its registry name.
"""
from typing import Callable, List, NamedTuple, Optional

from mmcv_custom.comm.records import HookRecord, has_record, record_of
from mmcv_custom.comm.registry import COMM_HOOKS

__all__ = [
    'RegisteredHook', 'registered_hooks', 'DEFAULT_COLOURS', 'HOW_TO_RECORD'
]

#: Plot colours for hooks whose record names none, in turn (none of them
#: a built-in's).
DEFAULT_COLOURS = ('tab:pink', 'tab:olive', 'tab:cyan', 'tab:gray')

#: How a hook gets a record, for a tool that says what it cannot tell of
#: a hook without one.
HOW_TO_RECORD = ('register it with @COMM_HOOKS.register_module(record='
                 'HookRecord(...)), see docs/en/advanced_guides/own_hooks.md')


class RegisteredHook(NamedTuple):
    """One registered hook as the analysis tools show it.

    Attributes:
        name (str): Its registry name (a config's ``type``).
        hook (Callable): The hook function.
        record (HookRecord): Its record (empty for a hook the project does
            not know).
        label (str): Its record's label, else its name.
        colour (str, optional): Its record's colour; None where the record
            names none.
    """
    name: str
    hook: Callable
    record: HookRecord
    label: str
    colour: Optional[str]

    @property
    def has_record(self) -> bool:
        """Whether it was registered with a record (else its record is
        the empty one: what it sends is unknown)."""
        return has_record(self.hook)


def registered_hooks() -> List[RegisteredHook]:
    """Every registered hook, in the order of registration, read now (so
    that a hook registered after this module was imported shows too)."""
    out = []
    for name, hook in COMM_HOOKS.module_dict.items():
        record = record_of(hook)
        out.append(
            RegisteredHook(name, hook, record, record.label or name,
                           record.colour))
    return out
