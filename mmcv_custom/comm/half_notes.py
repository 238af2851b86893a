"""What the log says of parameters a half-precision hook sends in their own
2-byte dtype (a bf16 backbone under ``fp16_compress``)."""
from typing import Callable, Optional

import torch

from .records import record_of

__all__ = ['describe_sent_as_they_are']


def describe_sent_as_they_are(checked, base_hook: Callable,
                              param_names: dict) -> Optional[str]:
    """Say which parameters a half-precision hook or wrapper sends in their
    own 2-byte dtype instead of its own (see ``hooks.half.wire_dtype_for``),
    e.g. a bf16 backbone under ``fp16_compress``: a user who asked for fp16
    should read that part of the model goes as bf16, and why."""
    wrapper = checked.wrapper
    sent_format = wrapper or record_of(base_hook).half_precision
    if sent_format is None:
        return None
    other = 'bf16' if sent_format == 'fp16' else 'fp16'
    dtype = torch.bfloat16 if other == 'bf16' else torch.float16
    names = [
        name for param, name in param_names.items()
        if param.requires_grad and param.dtype is dtype
    ]
    if not names:
        return None
    shown = ', '.join(
        names[:3]) + (f', ... ({len(names)} in all)' if len(names) > 3 else '')
    what = (f'type={checked.type!r}' +
            (f', wrapper={wrapper!r}' if wrapper is not None else ''))
    instead = (f"wrapper='{other}'"
               if wrapper is not None else f"type='{other}_compress'")
    why = ('fp16 has far less range than bf16: it would overflow above '
           '65504 and flush values below about 6e-8 to zero' if other == 'bf16'
           else 'bf16 keeps 3 fewer significant bits than fp16')
    return (f'comm_hook {what}: the {other} parameters ({shown}) are sent '
            f'as {other}, as they are, not cast to {sent_format} ({why}); the '
            f'bytes are the same. Only fp32 buckets are cast to '
            f'{sent_format}. '
            f'For one wire format everywhere use {instead}.')
