"""The plugins a tool's command line names, imported before the tool's
parser builds its hook choices.

MMEngine's runner imports a config's ``custom_imports`` before it builds
anything; a tool that offers the registered hooks as choices must do the
same before it builds its parser, or a hook a plugin registers is an
"invalid choice" although the config that trains it is the one the tool
was given. :func:`plugin_parser` does it in two passes: a lenient first
parse of the command line, only for the config (with its
``--cfg-options``) and ``--import MODULE`` (:func:`add_import_option`),
whose modules are imported (the config's ``custom_imports`` first, as a
run imports them); then the tool's parser, built anew, whose choices now
hold the plugins' hooks. A module that cannot be imported is a usage
error naming it and why.

A tool that starts processes of its own hands them ``--import``'s
modules (MMEngine's ``import_modules_from_strings`` on a rank,
:func:`custom_imports_options` for a training run): a config's
``custom_imports`` they read themselves.
"""
import argparse
import importlib
import sys
from typing import Callable, List, Optional, Sequence

__all__ = ['add_import_option', 'plugin_parser', 'custom_imports_options']


def add_import_option(parser,
                      what: str = 'the hooks it registers are choices '
                      'too') -> None:
    """Add ``--import MODULE``, repeatable (one module each, so that it
    never takes a positional config for a module): ``args.imports``, the
    modules in order, ``[]`` without it.

    Args:
        parser (argparse.ArgumentParser or argument group): The tool's.
        what (str): What importing them does for this tool, for the help.
    """
    parser.add_argument(
        '--import',
        dest='imports',
        action='append',
        default=[],
        metavar='MODULE',
        help='a module to import first (after a config\'s custom_imports), '
        f'repeatable: {what}')


def _innermost_import_error(error: BaseException):
    """The innermost ImportError behind ``error`` (MMEngine wraps a
    config's in one that lists ``sys.path``), or None."""
    found = None
    while error is not None:
        if isinstance(error, ImportError):
            found = error
        error = error.__cause__ or error.__context__
    return found


def _why(error: BaseException) -> str:
    """Why an import failed, in one line: the innermost ImportError's
    message, else the error with its type (a plugin that fails while it
    runs, e.g. one that registers a built-in hook's name)."""
    found = _innermost_import_error(error)
    if found is not None:
        text = str(found)
    elif isinstance(error, KeyError) and error.args:
        text = str(error.args[0])  # its str() is the message's repr
    else:
        text = str(error)
    line = (text.strip().splitlines() or [''])[0]
    if found is not None:
        return line or type(found).__name__
    return f'{type(error).__name__}: {line}' if line else type(error).__name__


class _Stop(Exception):
    """The first pass met something it leaves to the tool's own parse."""


def _stop(*args, **kwargs):
    raise _Stop


def _first_pass(make_parser: Callable[[], argparse.ArgumentParser],
                argv: List[str]) -> Optional[argparse.Namespace]:
    """The command line parsed leniently (no choices, types or required
    arguments; no help, no exit), for its config and ``--import``; None
    where even that fails (the tool's own parse then says why)."""
    parser = make_parser()
    # This parser is thrown away: loosening its actions touches nothing
    # the tool parses with.
    for action in parser._actions:
        action.choices, action.type, action.required = None, None, False
    parser.error = parser.exit = _stop
    try:
        return parser.parse_known_args(
            [a for a in argv if a not in ('-h', '--help')])[0]
    except _Stop:
        return None


def _import_config(parser, option: str, path: str,
                   items: Optional[List[str]]) -> None:
    """Import the ``custom_imports`` of the config at ``path`` (with
    ``--cfg-options`` ``items``), or ``parser.error`` where one cannot be
    imported. A config that does not read otherwise is left to the tool,
    which says so in its order."""
    from mmengine.utils import import_modules_from_strings

    from mmcv_custom.launching.preflight import PreflightError, checked_config
    from .cli import cfg_options
    lenient = argparse.ArgumentParser(add_help=False)
    lenient.error = _stop
    try:
        options = cfg_options(lenient, items)
    except _Stop:
        options = None
    try:
        cfg = checked_config(path, options, option=option)
        if cfg.get('custom_imports'):
            # Those --cfg-options adds; the file's are imported already.
            import_modules_from_strings(**cfg.custom_imports)
    except PreflightError as e:
        if _innermost_import_error(e) is not None:
            parser.error(f'{option} {path}: its custom_imports cannot be '
                         f'imported ({_why(e)})')
    except Exception as e:  # noqa: B902 (a plugin may raise anything)
        parser.error(f'{option} {path}: its custom_imports cannot be '
                     f'imported ({_why(e)})')


def plugin_parser(make_parser: Callable[[], argparse.ArgumentParser],
                  argv: Optional[Sequence[str]] = None,
                  config: Optional[str] = 'config') -> argparse.ArgumentParser:
    """The tool's parser, built once the plugins ``argv`` names are
    imported: its config's ``custom_imports`` (merged with its
    ``--cfg-options``), then ``--import``'s modules.

    Args:
        make_parser (Callable): Builds the tool's parser, reading the
            registered hooks for its choices; it must take
            ``--import`` (:func:`add_import_option`).
        argv (Sequence[str], optional): The command line. Defaults to
            ``sys.argv[1:]``.
        config (str, optional): The option (``'--config'``) or positional
            (``'config'``) that names the config, whose ``custom_imports``
            are imported; None for a tool without a config.

    Returns:
        argparse.ArgumentParser: ``make_parser()``, built after the
        imports, for the tool to parse ``argv`` with.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    first = _first_pass(make_parser, argv)
    if first is not None:
        dest = None if config is None else config.lstrip('-').replace('-', '_')
        path = getattr(first, dest, None) if dest else None
        if path:
            _import_config(make_parser(), config, path,
                           getattr(first, 'cfg_options', None))
        for module in getattr(first, 'imports', None) or []:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: B902 (a plugin may raise anything)
                make_parser().error(
                    f'--import {module}: cannot import it ({_why(e)})')
    return _with_plugin_hint(make_parser())


#: Said after argparse's "invalid choice", where a hook name may be a
#: plugin's whose module the command line did not name.
PLUGIN_HINT = ("; a plugin's hook is a choice once its module is imported: "
               '--import MODULE, or the config\'s custom_imports')


def _with_plugin_hint(parser: argparse.ArgumentParser):
    """``parser``, whose "invalid choice" errors among hook names (every
    tool offers ``'allreduce'`` among them) say how a plugin's hook becomes
    a choice: the names offered are only those imported."""
    error = parser.error

    def error_with_hint(message: str):
        if 'invalid choice' in message and "'allreduce'" in message:
            message += PLUGIN_HINT
        error(message)

    parser.error = error_with_hint
    return parser


def custom_imports_options(cfg, modules: Sequence[str]) -> List[str]:
    """The ``--cfg-options`` that make a training run of ``cfg`` import
    ``modules`` too (after its own ``custom_imports``): none without
    modules.

    Args:
        cfg (mmengine.Config): The run's config.
        modules (Sequence[str]): ``--import``'s modules.

    Returns:
        list[str]: ``['custom_imports.imports=[A,B,...]']`` or ``[]``.
    """
    if not modules:
        return []
    own = (cfg.get('custom_imports') or {}).get('imports', [])
    own = [own] if isinstance(own, str) else list(own)
    wanted = list(dict.fromkeys(own + list(modules)))
    return [f'custom_imports.imports=[{",".join(wanted)}]']
