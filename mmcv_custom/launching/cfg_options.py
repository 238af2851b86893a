"""``--cfg-options KEY=VALUE ...`` as every tool reads them.

MMEngine's ``DictAction`` reads numbers, booleans, bare words, lists and
tuples, but not a dict: it splits ``comm_hook=dict(type='diloco',
period=25)`` at its comma and then recurses until Python stops it (a
``RecursionError``, which names nothing the user wrote), and it reports an
unbalanced bracket with a bare ``assert``. A dict is what a user writes
first for ``comm_hook``, so a value holding ``dict(...)`` or ``{...}`` is
read here as the Python literal it writes (dicts inside lists and tuples
too); everything else as ``DictAction`` reads it; and what neither can
read is a usage error that names the item and how to write it.
"""
import argparse
import ast
import copy
import os
from typing import Any, Tuple

from mmengine.config import DictAction

from ..engine.process_group import LAUNCH_ENV
from .preflight.problems import PreflightError, Problem
from .preflight.report import exit_on_problems

__all__ = ['CfgOptionsAction', 'parse_cfg_option', 'read_literal']


class _QuoteNames(ast.NodeTransformer):
    """Bare words as strings (``type=diloco`` -> ``type='diloco'``),
    ``dict`` itself and ``True``/``False``/``None`` left alone."""

    def visit_Call(self, node: ast.Call) -> ast.Call:
        node.keywords = [self.visit(k) for k in node.keywords]
        node.args = [self.visit(a) for a in node.args]
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Constant(node.id), node)


def _how(key: str, value: str) -> str:
    """How to write ``value``: itself with its bare words quoted where
    that makes it a literal, else an example."""
    try:
        tree = _QuoteNames().visit(ast.parse(value.strip(), mode='eval'))
        _literal(tree.body)
        example = f'{key}={ast.unparse(tree.body)}'
    except (SyntaxError, ValueError):
        example = f"{key}=dict(type='name', period=25)"
    return (f'write strings in quotes and quote the whole item for the '
            f'shell: "{example}"')


def _literal(node: ast.AST) -> Any:
    """The value of ``node``: a Python literal, where ``dict(k=v, ...)``
    counts as one (MMEngine's configs write dicts that way)."""
    if isinstance(node, ast.Call):
        if not (isinstance(node.func, ast.Name) and node.func.id == 'dict'
                and not node.args and all(k.arg for k in node.keywords)):
            raise ValueError(f'{ast.unparse(node)} is a call; only dict(...) '
                             'of literal values is read')
        return {k.arg: _literal(k.value) for k in node.keywords}
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError('** in a dict is not read')
        return {
            _literal(k): _literal(v)
            for k, v in zip(node.keys, node.values)
        }
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f'{ast.unparse(node)} is not a literal') from None


def read_literal(text: str) -> Any:
    """``text`` as the Python literal it writes, ``dict(k=v, ...)``
    counting as one, nested ones too.

    Raises:
        SyntaxError, ValueError: It writes none (a name, a call).
    """
    return _literal(ast.parse(text.strip(), mode='eval').body)


def _writes_a_dict(value: str) -> bool:
    return 'dict(' in value or value.lstrip().startswith('{')


def parse_cfg_option(item: str) -> Tuple[str, Any]:
    """``KEY=VALUE`` as ``(key, value)``.

    Raises:
        ValueError: Naming ``item``: it has no ``=``, it writes a dict
            that is not a literal (a string without quotes, a name), or
            ``DictAction`` cannot read it (unbalanced brackets).
    """
    key, eq, value = item.partition('=')
    if not eq or not key:
        raise ValueError(f'{item!r}: expected KEY=VALUE')
    if _writes_a_dict(value):
        try:
            return key, read_literal(value)
        except (SyntaxError, ValueError) as e:
            why = e.msg if isinstance(e, SyntaxError) else str(e)
            raise ValueError(f'{item!r}: cannot read its value ({why}); '
                             f'{_how(key, value)}') from None
    try:
        return key, DictAction._parse_iterable(value)
    except (AssertionError, ValueError, SyntaxError, RecursionError) as e:
        raise ValueError(f'{item!r}: cannot read its value '
                         f'({str(e) or "unbalanced brackets"})') from None


def _exit_on_usage(prog: str, message: str) -> None:
    """Exit 2 with ``prog: error: message``, said once per node: every
    rank of ``dist_train.sh`` parses the same command line before any
    process group exists (the preflight's rule; the launcher is read from
    the environment, since ``--launcher`` may not be parsed yet). The
    usage text is left out: it says nothing about a value."""
    launcher = next(
        (name for name, env in LAUNCH_ENV.items() if env.local in os.environ),
        'none')
    exit_on_problems(PreflightError([Problem(message)]), prog, launcher)


class CfgOptionsAction(argparse.Action):
    """``--cfg-options``: each ``KEY=VALUE`` read by
    :func:`parse_cfg_option` into one dict, as ``DictAction`` collects
    them; a value it cannot read is a usage error (exit 2, one line a
    node) naming it."""

    def __call__(self, parser, namespace, values, option_string=None):
        options = copy.copy(getattr(namespace, self.dest, None) or {})
        for item in values if isinstance(values, list) else [values]:
            try:
                key, value = parse_cfg_option(item)
            except ValueError as e:
                _exit_on_usage(parser.prog,
                               f'{option_string or "--cfg-options"} {e}')
            options[key] = value
        setattr(namespace, self.dest, options)
