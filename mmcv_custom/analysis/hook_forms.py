"""The hooks a benchmark compares (``noop`` and every registered hook,
with the settings its record asks benchmarks to use), and how it names a
hook in one of its forms, flat or two-level,
so that a run compares both side by side: ``NAME`` (the hook as its
config builds it by default), ``NAME:flat`` and ``NAME:two_level``.

Issue 30 adds a ``topology`` key to the hooks' configs: ``'flat'`` keeps
today's collectives over all ranks, ``'auto'`` (its default) reduces
inside each node first and compresses only what crosses nodes, where
there are several nodes with several ranks each. A benchmark names the
forms rather than the key's values, because the question it answers is
"flat or two-level", and ``'auto'`` is two-level exactly where the
benchmark can tell the two apart (several ranks per node):

* ``NAME``: the hook's config as registered, no ``topology`` key (the
  hook's default form: flat for a hook without that key, ``'auto'``
  for one with it);
* ``NAME:flat``: ``topology='flat'``;
* ``NAME:two_level``: ``topology='auto'``, so that the hook decides as
  it does for a user who turns it on with ``comm_hook.type`` alone.

A hook whose config does not take ``topology`` refuses both suffixes in
the config check (:func:`~mmcv_custom.comm.builder.check_comm_hook_cfg`),
which a tool runs before any node starts.

The periodic hooks (``post_local_sgd``, ``diloco``) are not among them:
their DDP hook carries only the exchange inside the node, and the
synchronisation across nodes runs after the optimizer step every
``period`` steps, stepped by the run's runner hook, which a benchmark's
timed steps do not run; it would time the exchange inside the node alone.
Naming one is refused with how to measure it (:func:`parse_form_name`).
"""
import argparse
import functools

from .registered import registered_hooks

__all__ = [
    'FORMS', 'TWO_LEVEL', 'hook_configs', 'hook_labels', 'split_form',
    'form_config', 'parse_form_name', 'check_form_configs', 'takes_topology',
    'flat_form', 'resolved_form', 'form_label'
]

#: The suffixes after ``NAME:``, and the ``topology`` each sets.
FORMS = {'flat': 'flat', 'two_level': 'auto'}
#: The suffix of the two-level form.
TWO_LEVEL = 'two_level'


def hook_configs():
    """Hook name -> its ``comm_hook`` config, in the tool's order:
    ``noop`` (None: it sends nothing), then every registered hook but the
    periodic ones (see the module's docstring) with its record's
    ``benchmark_options``."""
    out = {'noop': None}
    for hook in registered_hooks():
        if not hook.record.periodic:
            out[hook.name] = dict(
                type=hook.name, **hook.record.benchmark_options)
    return out


def hook_labels():
    """Hook name -> its label in the plot's legend (its record's, else
    its name), for the hooks of :func:`hook_configs`."""
    labels = {'noop': 'noop'}
    labels.update(
        (h.name, h.label) for h in registered_hooks() if not h.record.periodic)
    return labels


def _not_stepped(base: str) -> str:
    """Why a benchmark of DDP steps refuses periodic hook ``base``, and
    how to measure it instead; empty for any other name."""
    if not any(h.name == base and h.record.periodic
               for h in registered_hooks()):
        return ''
    return (f'{base!r} synchronises the model across nodes every period '
            'optimizer steps, after the step; benchmark_step_time.py does '
            'not step that yet (it would time the exchange inside the node '
            'alone): measure it with tools/analysis_tools/'
            f'benchmark_periodic.py --hooks {base}:period=25, which trains '
            'it on emulated nodes and reports its average step over whole '
            "periods and its bytes across nodes beside allreduce's")


def split_form(name: str):
    """``'int8_compress:flat'`` -> ``('int8_compress', 'flat')``;
    ``'allreduce'`` -> ``('allreduce', None)``."""
    base, sep, form = name.partition(':')
    return base, (form if sep else None)


def form_config(name: str):
    """The ``comm_hook`` config of a hook form (None for ``noop``): the
    hook's benchmark config, plus the ``topology`` its suffix sets.

    Raises:
        KeyError: An unknown hook or suffix, naming the valid ones.
    """
    base, form = split_form(name)
    configs = hook_configs()
    if base not in configs:
        raise KeyError(f'{base!r} is not a hook; valid: '
                       f'{", ".join(configs)}')
    config = configs[base]
    if form is None:
        return config
    if form not in FORMS:
        raise KeyError(f'{form!r} is not a form of {base}; valid: '
                       f'{", ".join(FORMS)}')
    if config is None:
        raise KeyError(f'{base} sends nothing and has no forms: give it '
                       'without a suffix')
    return dict(config, topology=FORMS[form])


def parse_form_name(text: str) -> str:
    """``text`` if it names a hook form; else an
    ``argparse.ArgumentTypeError`` saying what is valid (for a periodic
    hook, why it is not and how to measure it): the ``type`` of a command
    line's ``--hooks``."""
    refusal = _not_stepped(split_form(text)[0])
    if refusal:
        raise argparse.ArgumentTypeError(refusal)
    try:
        form_config(text)
    except KeyError:
        raise argparse.ArgumentTypeError(
            f'invalid choice: {text!r} (choose from NAME or NAME:FORM, NAME '
            f'one of {", ".join(map(repr, hook_configs()))}, FORM one of '
            f'{", ".join(map(repr, FORMS))})') from None
    return text


def check_form_configs(names, ranks_per_node: int) -> None:
    """Check the config of each named form as a run checks its
    ``comm_hook``, so that a tool refuses a form before any rank starts
    rather than on every rank once they have; and refuse a two-level form
    with one rank per node, where it would be the flat one under another
    name.

    Raises:
        ValueError: ``'<name>: <why>'``.
    """
    from mmcv_custom.comm.builder import check_comm_hook_cfg
    for name in names:
        if split_form(name)[1] == TWO_LEVEL and ranks_per_node == 1:
            raise ValueError(
                f'{name}: the two-level form needs several ranks per node '
                '(with one, it is the flat form), but there is 1')
        config = form_config(name)
        if split_form(name)[1] is None or config is None:
            continue
        try:
            check_comm_hook_cfg(dict(config))
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f'{name}: ' + str(e).strip('"\'')) from None


@functools.lru_cache(maxsize=None)
def takes_topology(base: str) -> bool:
    """Whether hook ``base``'s config takes the ``topology`` key (asked of
    the config check, so that it follows the hook's own code)."""
    from mmcv_custom.comm.builder import check_comm_hook_cfg
    config = hook_configs().get(base)
    if config is None:
        return False
    try:
        check_comm_hook_cfg(dict(config, topology='flat'))
    except (TypeError, ValueError, KeyError):
        return False
    return True


def flat_form(name: str) -> str:
    """The name of the flat form of hook form ``name``'s hook:
    ``NAME:flat`` where its config takes ``topology``, else ``NAME``
    (which is flat)."""
    base = split_form(name)[0]
    return f'{base}:flat' if takes_topology(base) else base


def resolved_form(name: str, ranks_per_node: int) -> str:
    """``'flat'`` or ``'two_level'``: the collectives hook form ``name``
    issues on several nodes of ``ranks_per_node`` ranks each, as
    ``topology='auto'`` decides (:mod:`mmcv_custom.comm.topology`): two
    levels for a hook whose record has a two-level form
    (``HookRecord.two_level``) with several ranks per node, else flat."""
    base, form = split_form(name)
    if form == 'flat' or ranks_per_node == 1:
        return 'flat'
    hook = next((h for h in registered_hooks() if h.name == base), None)
    if hook is None or not getattr(hook.record, 'two_level', False):
        return 'flat'
    return TWO_LEVEL if form == TWO_LEVEL or takes_topology(base) else 'flat'


def form_label(name: str, labels: dict) -> str:
    """A hook form's label in a plot: its hook's label, and the form."""
    base, form = split_form(name)
    label = labels.get(base, base)
    return label if form is None else f'{label} ({form.replace("_", "-")})'
