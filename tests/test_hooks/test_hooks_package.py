"""The hook math as a package: ``mmcv_custom.hooks`` imports only torch,
and the seed's path still imports, as a thin re-export.

Code copied from InternVL's ``segmentation/mmcv_custom/ddp_hooks.py``
imports ``from mmcv_custom.ddp_hooks import fp16_compress_hook,
bf16_compress_hook`` and its configs name
``type='mmcv_custom.ddp_hooks.fp16_compress_hook'``, so that path must hand
out the very objects the hooks package defines; and the package must stay
usable without MMEngine and without the rest of the project.
"""
import ast
import importlib
import importlib.util
import json
import os.path as osp
import pkgutil
import subprocess
import sys

import pytest

import mmcv_custom.hooks

# The seed's module -> the modules its public names now come from.
OLD_PATHS = {
    'mmcv_custom.ddp_hooks':
    ('mmcv_custom.hooks.half', 'mmcv_custom.hooks.cast'),
}

HOOKS_DIR = osp.dirname(mmcv_custom.hooks.__file__)
PACKAGE_DIR = osp.dirname(HOOKS_DIR)
HOOK_MODULES = sorted(f'mmcv_custom.hooks.{info.name}'
                      for info in pkgutil.iter_modules([HOOKS_DIR]))
#: Modules that need an optional package (imported only when it is there).
OPTIONAL = {'mmcv_custom.hooks.int8_fused_kernels': 'triton'}
#: Those that import here.
IMPORTABLE = [
    m for m in HOOK_MODULES
    if importlib.util.find_spec(OPTIONAL.get(m, 'torch')) is not None
]


def _home(name: str, new_modules) -> object:
    """The object ``name`` is in the one new module that defines it."""
    homes = [
        importlib.import_module(new) for new in new_modules
        if name in importlib.import_module(new).__all__
    ]
    assert len(homes) == 1, f'{name} is public in {len(homes)} new modules'
    return getattr(homes[0], name)


@pytest.mark.parametrize('old', sorted(OLD_PATHS))
def test_old_path_re_exports_the_same_objects(old):
    module = importlib.import_module(old)
    assert module.__all__, old
    for name in module.__all__:
        assert getattr(module, name) is _home(name, OLD_PATHS[old]), name


@pytest.mark.parametrize('old', sorted(OLD_PATHS))
def test_old_path_is_a_thin_re_export(old):
    """A docstring, ``from <new> import ...`` and ``__all__``: no logic."""
    path = importlib.import_module(old).__file__
    with open(path) as f:
        tree = ast.parse(f.read())
    docstring, *body = tree.body
    assert isinstance(docstring, ast.Expr), path
    for node in body:
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(
                '.' * node.level + node.module, package=old.rsplit('.', 1)[0])
            assert module.__name__ in OLD_PATHS[old], (path, node.module)
        else:
            assert isinstance(node, ast.Assign), (path, ast.dump(node))
            assert [t.id for t in node.targets] == ['__all__'], path


def test_the_seeds_import_still_works():
    """The two names InternVL's file defines, as its users import them."""
    from mmcv_custom.ddp_hooks import bf16_compress_hook, fp16_compress_hook
    from mmcv_custom.hooks import half
    assert fp16_compress_hook is half.fp16_compress_hook
    assert bf16_compress_hook is half.bf16_compress_hook


def test_config_type_may_still_name_an_old_path():
    from mmcv_custom.comm import COMM_HOOKS
    from mmcv_custom.hooks.half import fp16_compress_hook
    assert (COMM_HOOKS.get('mmcv_custom.ddp_hooks.fp16_compress_hook')
            is fp16_compress_hook)


def _static_imports(path: str):
    """``(level, module, names)`` of every import statement in ``path``,
    also those inside functions."""
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            yield (node.level, node.module
                   or '', tuple(alias.name for alias in node.names))


@pytest.mark.parametrize('module', HOOK_MODULES + ['mmcv_custom.hooks'])
def test_hook_modules_import_only_torch(module):
    """Each module imports torch (numpy, for PowerSGD's saved random
    state; Triton, torch's own kernel language, for the fused int8 kernels,
    imported only when they are used), the standard library, its siblings,
    and from the package above only the optional C kernel ``_cpu_codec``
    (plain C, imports nothing)."""
    path = importlib.util.find_spec(module).origin  # not run: read
    for level, name, names in _static_imports(path):
        if level == 0:
            top = name.split('.')[0]
            assert (top in ('torch', 'numpy') or top in sys.stdlib_module_names
                    or (top == 'triton'
                        and path.endswith('int8_fused_kernels.py'))), (path,
                                                                       name)
        elif level == 1:
            assert not name or osp.isfile(
                osp.join(HOOKS_DIR,
                         name.split('.')[0] + '.py')), (path, name)
        else:
            assert (level, name, names) == (2, '', ('_cpu_codec', )), path


def test_hooks_package_pulls_in_nothing_else_of_the_project():
    """Imported in a fresh interpreter, with every one of its modules: no
    module of ``mmcv_custom`` outside ``mmcv_custom.hooks`` (but the C
    kernel) and no MMEngine. The ``mmcv_custom`` package stands in as an
    empty one, because its ``__init__`` registers the MMEngine glue."""
    code = '\n'.join([
        'import importlib, json, sys, types',
        'pkg = types.ModuleType("mmcv_custom")',
        f'pkg.__path__ = [{PACKAGE_DIR!r}]',
        'sys.modules["mmcv_custom"] = pkg',
        f'for name in {["mmcv_custom.hooks"] + IMPORTABLE!r}:',
        '    importlib.import_module(name)',
        'print(json.dumps(sorted(sys.modules)))',
    ])
    out = subprocess.run([sys.executable, '-c', code],
                         capture_output=True,
                         text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout)
    assert set(IMPORTABLE) <= set(loaded)
    outside = [
        name for name in loaded
        if name.split('.')[0] == 'mmcv_custom' and name not in (
            'mmcv_custom', 'mmcv_custom._cpu_codec') and name !=
        'mmcv_custom.hooks' and not name.startswith('mmcv_custom.hooks.')
    ]
    assert outside == []
    assert [name for name in loaded if name.split('.')[0] == 'mmengine'] == []
