"""The old import paths of the preflight and the emulated cluster, now
thin re-exports of ``mmcv_custom.launching``: every name a user may have
imported from them is the very object of the new package."""
import importlib

import pytest

OLD_TO_NEW = {
    'mmcv_custom.preflight': 'mmcv_custom.launching.preflight',
    'mmcv_custom.emulated_cluster': 'mmcv_custom.launching.emulated_cluster',
}


@pytest.mark.parametrize('old,new', sorted(OLD_TO_NEW.items()))
def test_old_path_re_exports_the_new_objects(old, new):
    old_module = importlib.import_module(old)
    new_module = importlib.import_module(new)
    assert old_module.__all__, old
    assert sorted(old_module.__all__) == sorted(new_module.__all__)
    for name in old_module.__all__:
        assert getattr(old_module, name) is getattr(new_module, name), name
