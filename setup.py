"""Install mmcv_custom: ``pip install -e .`` (``[seg]`` adds MMSegmentation).

torch is required without a version pin, so pip keeps whatever torch (CUDA
or CPU) is already installed.
"""
import os.path as osp
import sys
from setuptools import Extension, find_packages, setup


def _read(*parts):
    with open(osp.join(osp.dirname(osp.abspath(__file__)), *parts)) as f:
        return f.read()


def _requirements(name):
    lines = _read('requirements', name).splitlines()
    return [
        ln.strip() for ln in lines if ln.strip() and not ln.startswith('#')
    ]


def _cpu_codec():
    """The optional one-pass CPU scale-and-cast kernel of the comm hooks.

    Plain C against Python's headers only (no torch headers, so it builds in
    a second). ``optional``: without a C compiler the install still
    succeeds and the hooks use torch's ops instead (see
    ``mmcv_custom.hooks.cast.cpu_codec``).
    """
    # No fused multiply-add: the int8 kernels must round each fp32 step as
    # torch's separate operations do (see the C file).
    args = [] if sys.platform == 'win32' else ['-O3', '-ffp-contract=off']
    return Extension(
        'mmcv_custom._cpu_codec',
        sources=['mmcv_custom/csrc/cpu_codec.c'],
        extra_compile_args=args,
        optional=True)


def _version():
    scope = {}
    exec(_read('mmcv_custom', 'version.py'), scope)
    return scope['__version__']


setup(
    name='mmcv_custom',
    version=_version(),
    description='Half-precision DDP gradient communication hooks for '
    'MMEngine / MMSegmentation training',
    long_description=_read('README.md'),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['mmcv_custom', 'mmcv_custom.*']),
    python_requires='>=3.8',
    ext_modules=[_cpu_codec()],
    install_requires=_requirements('runtime.txt'),
    extras_require={
        'seg':
        ['mmcv>=2.0.0rc4,<2.2.0', 'mmsegmentation>=1.0.0', 'ftfy', 'regex'],
        'tests': ['pytest'],
        # MMEngine's TensorboardVisBackend writes through torch's
        # SummaryWriter, which needs it.
        'vis': ['tensorboard'],
    },
    license='Apache-2.0',
    zip_safe=False,
)
