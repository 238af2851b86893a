"""The package's layers, read from the sources themselves.

``docs/en/design/layout.md`` promises which package may import which, no
import circles, modules of a readable size, and a line for every module.
These tests hold the code to it, so the layout cannot drift from the page
unnoticed: a new module without its line, an import up the layers or a
circle fails here, naming the module.
"""
import ast
import os
import os.path as osp
import re

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
PACKAGE = osp.join(ROOT, 'mmcv_custom')
LAYOUT = osp.join(ROOT, 'docs', 'en', 'design', 'layout.md')

#: What each part of the package may import of the package (besides
#: itself). Read bottom-up: the hook math imports nothing of ours.
MAY_IMPORT = {
    'hooks': set(),
    'testing': set(),
    'comm': {'hooks'},
    'integrity': set(),
    'engine': {'hooks', 'comm', 'integrity'},
    'launching': {'hooks', 'comm', 'integrity', 'engine'},
    'analysis': {'hooks', 'comm', 'integrity', 'engine', 'launching'},
    'models': {'integrity', 'engine'},
    'datasets': set(),
    'demo': set(),
    'version': set(),
}

#: The package's entry point: it may import anything, nothing imports it.
ENTRY_POINTS = {'mmcv_custom'}

#: The one old import path with users: the seed's, ``from
#: mmcv_custom.ddp_hooks import fp16_compress_hook, bf16_compress_hook``
#: (InternVL's ``segmentation/mmcv_custom/ddp_hooks.py``). A project never
#: released keeps no other.
SEED_PATHS = {'mmcv_custom.ddp_hooks'}

#: Longest module, and longest script under tools/, in lines.
MAX_MODULE_LINES = 620
MAX_SCRIPT_LINES = 330


def _modules():
    """Every module of the package: dotted name -> path."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith('.py'):
                continue
            path = osp.join(folder, name)
            parts = osp.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[-1] == '__init__':
                parts = parts[:-1]
            found['.'.join(parts)] = path
    return found


MODULES = _modules()


def _is_shim(name):
    """A thin re-export: a module (not a package) of nothing but a
    docstring, imports and ``__all__``."""
    if MODULES[name].endswith('__init__.py') or name in ENTRY_POINTS:
        return False
    with open(MODULES[name]) as f:
        body = ast.parse(f.read()).body
    for i, node in enumerate(body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(
                node.value, ast.Constant):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign) and [
                getattr(target, 'id', None) for target in node.targets
        ] == ['__all__']:
            continue
        return False
    return True


SHIMS = {name for name in MODULES if _is_shim(name)}


def _imports(name):
    """The package's modules that ``name`` imports, functions' imports
    included (an import put off into a function is still a dependency)."""
    with open(MODULES[name]) as f:
        tree = ast.parse(f.read())
    is_package = MODULES[name].endswith('__init__.py')
    here = name.split('.') if is_package else name.split('.')[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                module = '.'.join(base +
                                  ([node.module] if node.module else []))
            else:
                module = node.module or ''
            # ``from .. import _cpu_codec``: the compiled extension, not
            # the package's ``__init__``.
            compiled = all(alias.name.startswith('_') for alias in node.names)
            targets = [] if compiled and module == 'mmcv_custom' else [module]
            # ``from . import x`` and ``from .pkg import mod`` name modules.
            targets += [
                f'{module}.{alias.name}' for alias in node.names
                if f'{module}.{alias.name}' in MODULES
            ]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def _part(name):
    """The part of the package a module belongs to (``hooks``,
    ``engine``, ...), or None for the package itself."""
    parts = name.split('.')
    return parts[1] if len(parts) > 1 else None


def test_the_only_re_export_is_the_seeds_path():
    """Modules that only hand on another's names are old paths kept for
    users; the seed's is the one this project has."""
    assert SHIMS == SEED_PATHS


def test_no_module_imports_up_the_layers():
    wrong = []
    for name in sorted(set(MODULES) - SHIMS - ENTRY_POINTS):
        part = _part(name)
        allowed = MAY_IMPORT.get(part)
        assert allowed is not None, (
            f'{name}: its part {part!r} has no place in the layers; add it '
            'to MAY_IMPORT here and to docs/en/design/layout.md')
        for target in sorted(_imports(name)):
            other = _part(target)
            if target in SHIMS or target in ENTRY_POINTS:
                wrong.append(f'{name} imports {target}, an old import path '
                             '(import the module it re-exports)')
            elif other != part and other not in allowed:
                wrong.append(f'{name} ({part}) imports {target} ({other})')
    assert not wrong, '\n'.join(wrong)


def test_no_import_circles():
    graph = {name: _imports(name) for name in MODULES}
    circles = []
    state = {}

    def visit(name, path):
        state[name] = 'open'
        for target in sorted(graph[name]):
            # A package imports its own modules; that is not a circle.
            if target.startswith(name + '.'):
                continue
            if state.get(target) == 'open':
                start = path.index(target) if target in path else 0
                circles.append(' -> '.join(path[start:] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = 'done'

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, '\n'.join(circles)


@pytest.mark.parametrize('folder,limit', [('mmcv_custom', MAX_MODULE_LINES),
                                          ('tools', MAX_SCRIPT_LINES)])
def test_modules_and_scripts_stay_readable(folder, limit):
    long = []
    for base, _, files in os.walk(osp.join(ROOT, folder)):
        for name in files:
            if name.endswith('.py'):
                path = osp.join(base, name)
                with open(path) as f:
                    lines = sum(1 for _ in f)
                if lines > limit:
                    long.append(f'{osp.relpath(path, ROOT)}: {lines} lines')
    assert not long, f'over {limit} lines: ' + ', '.join(long)


def test_layout_page_lists_every_module():
    with open(LAYOUT) as f:
        page = f.read()
    listed = set(re.findall(r'`(mmcv_custom/[\w/]+\.py)`', page))
    paths = {
        osp.relpath(path, ROOT)
        for name, path in MODULES.items()
        if not path.endswith('__init__.py') and '/_' not in path[len(ROOT):]
    }
    missing = sorted(paths - listed)
    assert not missing, ('docs/en/design/layout.md has no line for: ' +
                         ', '.join(missing))
    stale = sorted(p for p in listed if not osp.exists(osp.join(ROOT, p)))
    assert not stale, ('docs/en/design/layout.md lists modules that do not '
                       'exist: ' + ', '.join(stale))


def test_tests_mirror_the_package():
    """A folder of tests for each part of the package that has modules of
    its own (``tests/test_hooks/`` for ``mmcv_custom/hooks/``, ...), and
    besides them only the command lines' and the GPU's."""
    tests = osp.join(ROOT, 'tests')
    folders = {
        name[len('test_'):]
        for name in os.listdir(tests)
        if name.startswith('test_') and osp.isdir(osp.join(tests, name))
    }
    # Parts whose tests live with the part that uses them: the test
    # harness itself, the checkpoint files (tested through the engine's
    # writers), the toy data and the demo (through the tools).
    through_others = {
        'testing', 'integrity', 'datasets', 'demo', 'version', 'ddp_hooks'
    }
    parts = {_part(name) for name in MODULES} - {None} - through_others
    assert folders == parts | {'tools', 'cuda'
                               }, sorted(folders ^ (parts | {'tools', 'cuda'}))
