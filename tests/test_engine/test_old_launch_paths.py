"""The old import paths of the modules moved into ``mmcv_custom.integrity``
and ``mmcv_custom.launching`` (issue 29) still give users the same objects.

Each old module is now a thin re-export: every name in its ``__all__`` must
be the very object the new module defines (not a copy, so that
``isinstance`` checks, registries and monkeypatching see one thing), and
found in exactly one of the new modules it names. (``mmcv_custom.launcher``
also lists ``restart_count``, public there and imported from there before,
though not in its old ``__all__``.)
"""
import importlib

import pytest

#: Old path -> the new modules its names now live in.
OLD_TO_NEW = {
    'mmcv_custom.integrity': ['mmcv_custom.integrity.files'],
    'mmcv_custom.checkpoint': [
        'mmcv_custom.integrity.checkpoint',
        'mmcv_custom.integrity.checkpoint_choice'
    ],
    'mmcv_custom.sharded_checkpoint':
    ['mmcv_custom.integrity.sharded_checkpoint'],
    'mmcv_custom.launcher': [
        'mmcv_custom.engine.process_group', 'mmcv_custom.launching.cpu_start',
        'mmcv_custom.launching.running', 'mmcv_custom.launching.ports',
        'mmcv_custom.launching.bench_ranks',
        'mmcv_custom.launching.output_paths'
    ],
    'mmcv_custom.torchrun': ['mmcv_custom.launching.torchrun'],
    'mmcv_custom.lifetime': ['mmcv_custom.launching.lifetime'],
    'mmcv_custom.work_dir_lock': ['mmcv_custom.launching.work_dir_lock'],
    'mmcv_custom.run_start': ['mmcv_custom.launching.run_start'],
    'mmcv_custom.engine.console': ['mmcv_custom.launching.console'],
}


@pytest.mark.parametrize('old_path', sorted(OLD_TO_NEW))
def test_old_path_gives_the_new_objects(old_path):
    old = importlib.import_module(old_path)
    new = [importlib.import_module(path) for path in OLD_TO_NEW[old_path]]
    assert old.__all__, f'{old_path} exports nothing'
    assert len(set(old.__all__)) == len(old.__all__), old.__all__
    for name in old.__all__:
        homes = [module for module in new if name in module.__all__]
        assert len(homes) == 1, (
            f'{old_path}.{name} should be in the __all__ of exactly one of '
            f'{OLD_TO_NEW[old_path]}, but is in '
            f'{[module.__name__ for module in homes]}')
        where = f'{homes[0].__name__}.{name}'
        assert getattr(old, name) is getattr(homes[0], name), where
