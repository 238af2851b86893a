"""The tools that start ``tools/dist_train.sh`` themselves (``tools/demo.py``,
``compare_comm_convergence.py``) take ``PORT`` as ``dist_train.sh`` does,
and check it before any run starts: not a port, or one another process
listens on (a real socket here), is a usage error naming it; unset, each
run takes a free port. Parsed in this process; that the runs then use
the port is checked end to end by the slow tests of each tool
(``test_tools.py``, ``test_compare_comm_convergence.py``)."""
import os.path as osp
import socket

import pytest

from tests.tool_utils import load_script, usage_errors

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
FCN = osp.join(ROOT, 'configs', 'fcn',
               'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')
DEMO = osp.join(ROOT, 'tools', 'demo.py')
CONVERGENCE = osp.join(ROOT, 'tools', 'analysis_tools',
                       'compare_comm_convergence.py')
TOOLS = {
    'demo': (DEMO, lambda tmp: ['--work-dir', str(tmp)]),
    'convergence':
    (CONVERGENCE, lambda tmp: [FCN, '--work-dir', str(tmp)]),
}


@pytest.fixture(params=sorted(TOOLS))
def tool(request, tmp_path, monkeypatch, capsys):
    """(the tool's parse_args, a function expecting its usage error, its
    arguments and its script name)."""
    path, argv = TOOLS[request.param]
    module = load_script(path, f'_port_{request.param}')
    monkeypatch.delenv('PORT', raising=False)
    monkeypatch.delenv('NODE_RANK', raising=False)
    monkeypatch.chdir(ROOT)
    return (module.parse_args, usage_errors(module, path, monkeypatch, capsys),
            argv(tmp_path), osp.basename(path))


@pytest.fixture
def listening():
    """A port another process (here: a socket of this one) listens on."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        s.listen()
        yield s.getsockname()[1]


def test_unset_port_leaves_each_run_a_free_one(tool, monkeypatch):
    parse, _, argv, _ = tool
    assert parse(argv).port is None
    monkeypatch.setenv('PORT', '')  # as dist_train.sh reads it: unset
    assert parse(argv).port is None


def test_a_free_port_is_taken_as_given(tool, monkeypatch):
    parse, _, argv, _ = tool
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    monkeypatch.setenv('PORT', str(port))
    assert parse(argv).port == str(port)


@pytest.mark.parametrize('value', ['29600x', '0', '65536', '-1', ' 29600'])
def test_a_port_that_is_not_one_is_a_usage_error(tool, value, monkeypatch):
    _, refused, argv, name = tool
    monkeypatch.setenv('PORT', value)
    assert refused(argv) == (
        2, f'{name}: error: PORT={value!r} is not a TCP port: give an int '
        'from 1 to 65535, or leave PORT unset for a free port')


def test_a_port_another_process_listens_on_is_named(tool, listening,
                                                    monkeypatch):
    parse, refused, argv, name = tool
    monkeypatch.setenv('PORT', str(listening))
    assert refused(argv) == (
        2, f'{name}: error: PORT={listening} cannot be used on this host '
        '(another process listens there): set PORT to a free port, or leave '
        'it unset for a free one')
    # On a node other than the first, the port is the first node's.
    monkeypatch.setenv('NODE_RANK', '1')
    assert parse(argv).port == str(listening)
