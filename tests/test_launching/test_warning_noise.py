"""Known third-party warnings kept off the tools' consoles
(``mmcv_custom/launching/warning_noise.py``) and ``--cfg-options``
dicts (``mmcv_custom.launching.running``): the exact warning silenced
where it arises and any other still shown, through the real reading of a
config and a real tool."""
import os.path as osp
import subprocess
import sys
import warnings

import pytest

from mmcv_custom.launching.running import load_config, read_dicts
from mmcv_custom.launching.warning_noise import CONFIG_NOISE, TOOL_NOISE, quiet

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
# An mmseg:: config: MMEngine finds its bases through pkg_resources.
R50 = osp.join(ROOT, 'configs', 'upernet',
               'upernet_r50_4xb4-allreduce-160k_ade20k-512x512.py')
PKG_RESOURCES = ('pkg_resources is deprecated as an API. See '
                 'https://setuptools.pypa.io/en/latest/pkg_resources.html.')


def _shown(*warned):
    """The messages of ``warned`` (message, category, module) that show
    under ``quiet(CONFIG_NOISE)``, every filter else set to always."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with quiet(CONFIG_NOISE):
            for message, category, module in warned:
                warnings.warn_explicit(message, category, f'{module}.py', 1,
                                       module)
    return [(str(w.message), w.category, w.filename) for w in caught]


def test_every_entry_says_why():
    for noise in (TOOL_NOISE, CONFIG_NOISE):
        assert all(len(entry) == 4 and entry[3] for entry in noise)


def test_only_the_exact_warning_from_its_module_is_silenced():
    silenced = [(PKG_RESOURCES, UserWarning, 'mmengine.utils.package_utils'),
                (PKG_RESOURCES, UserWarning, 'importlib')]
    shown = [
        # The same message from other code, or of another category.
        (PKG_RESOURCES, UserWarning, 'mmcv_custom.analysis.cost.model'),
        (PKG_RESOURCES, UserWarning, 'importlib.util'),
        (PKG_RESOURCES, DeprecationWarning, 'mmengine.utils.package_utils'),
        # Another warning from the same code.
        ('pkg_resources: get_distribution failed', UserWarning,
         'mmengine.utils.package_utils'),
    ]
    assert _shown(*silenced,
                  *shown) == [(m, c, f'{mod}.py') for m, c, mod in shown]
    # After the block, the filters are as they were.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        warnings.warn_explicit(PKG_RESOURCES, UserWarning, 'importlib.py', 1,
                               'importlib')
    assert len(caught) == 1


def test_reading_an_mmseg_config_warns_nothing_of_pkg_resources():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        cfg = load_config(R50)
    assert cfg.model.backbone.type == 'ResNetV1c'
    assert not [w for w in caught if 'pkg_resources' in str(w.message)]


def test_a_tool_prints_no_pkg_resources_warning_but_a_real_one():
    """Issue 42: three pkg_resources warnings on every analysis tool that
    read an mmseg:: config. MMSegmentation's own deprecation of the R50
    config's ``pretrained`` key is the user's to act on, and shows."""
    done = subprocess.run([
        sys.executable,
        osp.join(ROOT, 'tools', 'analysis_tools', 'model_stats.py'), R50
    ],
                          capture_output=True,
                          text=True,
                          timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'pkg_resources' not in done.stderr
    assert 'UserWarning: DeprecationWarning: pretrained is a deprecated' \
        in done.stderr


@pytest.mark.parametrize(
    'value, read',
    [
        ("dict(type='TensorboardVisBackend')",
         dict(type='TensorboardVisBackend')),
        (["dict(type='LocalVisBackend')", "{'type': 'X', 'n': 2}"
          ], [dict(type='LocalVisBackend'),
              dict(type='X', n=2)]),
        (('dict(a=(1, 2))', 3), (dict(a=(1, 2)), 3)),
        # Not a dict of literals: left as MMEngine gave it.
        ('dict(type=TensorboardVisBackend)', 'dict(type=TensorboardVisBackend)'
         ),
        ('dict(**x)', 'dict(**x)'),
        ('dict(a', 'dict(a'),
        ('bf16_compress', 'bf16_compress'),
        (0.5, 0.5),
    ],
    ids=[
        'dict', 'in-a-list', 'in-a-tuple', 'bare-name', 'unpacking',
        'unclosed', 'word', 'number'
    ])
def test_cfg_options_dicts_are_read_as_dicts(value, read):
    assert read_dicts(value) == read
