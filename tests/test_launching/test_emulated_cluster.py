"""The emulated cluster (``mmcv_custom/launching/emulated_cluster/`` and
``tools/emulated_cluster.py``) on real network namespaces: what it makes
and that it all goes, the shaping, who reaches whom, that a failing node,
a timeout or a signal stops every node and removes everything, the usage
errors, the link counters (``--link-bytes``), a calibration, the
non-root path, and (slow) a 2-node training run
and its resume through the tool. Tests skip, with the reason, where
namespaces cannot be made."""
import io
import ipaddress
import os
import os.path as osp
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from mmcv_custom.launching import emulated_cluster as ec
from mmcv_custom.launching.emulated_cluster.namespaces import run_command
from tests.tool_utils import load_script, netns_names, toy_set, usage_errors

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'emulated_cluster.py')
FCN = osp.join(ROOT, 'configs', 'fcn',
               'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')

_REASON = ec.check_available()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
# The tool also works without root, through a user namespace.
_TOOL_REASON = (
    _REASON
    if os.geteuid() == 0 or _REASON is None else ec.check_user_namespace())
needs_tool = pytest.mark.skipif(
    _TOOL_REASON is not None, reason=str(_TOOL_REASON))


def _out(*cmd) -> str:
    return subprocess.run(
        cmd, capture_output=True, text=True, check=True).stdout


def _links() -> set:
    """Interface names of this network namespace."""
    return {
        ln.split(':')[1].strip().split('@')[0]
        for ln in _out('ip', '-o', 'link', 'show').splitlines()
    }


def _sleeping(seconds: str) -> list:
    """Pids of ``sleep SECONDS`` (a number no other test uses)."""
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                if f.read() == f'sleep\0{seconds}\0'.encode():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _unique_seconds() -> str:
    return f'{secrets.randbelow(10**6) + 10**6}.25'


def _tool_namespaces(stdout: str) -> set:
    """The namespaces the tool's header names."""
    return set(re.findall(r'\b(mmcvc-\d+-[0-9a-f]+-(?:node\d+|sw))\b', stdout))


def _tool(*args, timeout=120, **kwargs):
    return subprocess.run([sys.executable, TOOL, *args],
                          capture_output=True,
                          text=True,
                          timeout=timeout,
                          **kwargs)


# The library ----------------------------------------------------------
@needs_netns
def test_cluster_makes_namespaces_and_links_then_removes_them():
    netns_before, links_before = netns_names(), _links()
    with ec.EmulatedCluster(3, bandwidth_mbit=100) as cluster:
        made = set(cluster.namespaces)
        assert len(made) == 4 and made <= netns_names()
        assert all(n.startswith(f'mmcvc-{os.getpid()}-') for n in made)
        # Nothing in the caller's namespace: the veths are born inside.
        assert _links() == links_before
        switch_ports = _out('ip', '-n', cluster.switch, '-o', 'link', 'show',
                            'master', 'br0')
        assert re.findall(r': (n\d)@', switch_ports) == ['n0', 'n1', 'n2']
        for node in cluster.nodes:
            ns = node.namespace
            inet = _out('ip', '-n', ns, '-o', '-4', 'addr', 'show', 'dev',
                        'eth0').split()[3]
            address = ipaddress.ip_interface(inet)
            assert str(address.ip) == node.address
            assert address.ip in ipaddress.ip_network('198.18.0.0/15')
            assert 'UP' in _out('ip', '-n', ns, 'link', 'show', 'lo')
            # No default route, no way out.
            assert _out('ip', '-n', ns, 'route', 'show', 'default') == ''
            out = subprocess.run(['ip', '-n', ns, 'route', 'get', '1.1.1.1'],
                                 capture_output=True,
                                 text=True)
            assert out.returncode != 0
            assert 'unreachable' in out.stderr
        assert [n.address for n in cluster.nodes
                ] == ['198.18.0.1', '198.18.0.2', '198.18.0.3']
    assert not made & netns_names()
    assert netns_names() - netns_before == set()
    assert _links() == links_before


@needs_netns
def test_links_are_shaped_both_ways_or_not_at_all():
    with ec.EmulatedCluster(2, bandwidth_mbit=100) as shaped, \
            ec.EmulatedCluster(2) as unshaped:
        for node in shaped.nodes:
            # Upload (the node's egress) and download (the switch's egress
            # towards the node).
            for ns, dev in ((node.namespace, 'eth0'), (shaped.switch,
                                                       node.switch_port)):
                qdisc = _out('tc', '-n', ns, 'qdisc', 'show', 'dev', dev)
                assert re.search(
                    r'qdisc tbf \S+ root .*rate 100Mbit '
                    r'burst 64Kb lat 50ms', qdisc), qdisc
        for node in unshaped.nodes:
            for ns, dev in ((node.namespace, 'eth0'), (unshaped.switch,
                                                       node.switch_port)):
                qdisc = _out('tc', '-n', ns, 'qdisc', 'show', 'dev', dev)
                assert 'tbf' not in qdisc, qdisc


def test_rate_changes_in_place_and_goes_away():
    """What the step-time benchmark does between measurements."""

    def qdiscs(cluster):
        return [
            _out('tc', '-n', ns, 'qdisc', 'show', 'dev', dev)
            for ns, dev in cluster.shaped_links
        ]

    with ec.EmulatedCluster(3) as cluster:
        assert len(cluster.shaped_links) == 6  # both ends of 3 links
        assert not any('tbf' in q for q in qdiscs(cluster))
        cluster.set_bandwidth(200)
        assert all(
            re.search(r'tbf .*rate 200Mbit', q) for q in qdiscs(cluster))
        assert cluster.bandwidth_mbit == 200
        cluster.set_bandwidth(1000)
        assert all(re.search(r'tbf .*rate 1Gbit', q) for q in qdiscs(cluster))
        cluster.set_bandwidth(None)
        assert not any('tbf' in q for q in qdiscs(cluster))
        with pytest.raises(ValueError, match='but got -1'):
            cluster.set_bandwidth(-1)
        assert cluster.bandwidth_mbit is None


def test_tbf_bucket_grows_with_the_rate_above_256_mbit():
    assert ec.tbf_burst_bytes(50) == 65536
    assert ec.tbf_burst_bytes(256) == 65536
    assert ec.tbf_burst_bytes(1000) == 250000  # 2 ms at 1 Gbit/s


_ECHO = r'''
import errno, os, socket, time
rank, n = int(os.environ['NODE_RANK']), int(os.environ['NNODES'])
port = int(os.environ['PORT'])
if rank == 0:
    server = socket.create_server(('0.0.0.0', port))
    for _ in range(n - 1):
        conn, (peer, _) = server.accept()
        with conn:
            conn.sendall(b'echo ' + conn.recv(64) + b' from ' +
                         peer.encode())
else:
    for _ in range(200):
        try:
            conn = socket.create_connection((os.environ['MASTER_ADDR'],
                                             port), timeout=5)
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    with conn:
        conn.sendall(b'node%d' % rank)
        print(conn.recv(64).decode())
    try:  # TEST-NET-1: outside the cluster
        socket.create_connection(('192.0.2.1', port), timeout=5)
    except OSError as e:
        print('outside:', errno.errorcode[e.errno])
'''


@needs_netns
def test_nodes_reach_each_other_and_nothing_else(tmp_path):
    stream = io.StringIO()
    with ec.EmulatedCluster(3, bandwidth_mbit=50) as cluster:
        result = ec.run_on_nodes(
            cluster, [sys.executable, '-c', _ECHO],
            port=12345,
            stream=stream,
            log_dir=str(tmp_path),
            timeout=60)
    assert result.returncode == 0, stream.getvalue()
    assert result.returncodes == (0, 0, 0)
    lines = stream.getvalue().splitlines()
    for rank in (1, 2):
        assert f'[node{rank}] echo node{rank} from 198.18.0.{rank + 1}' \
            in lines
        assert f'[node{rank}] outside: ENETUNREACH' in lines
    # The logs hold the same lines, without the prefix.
    assert (tmp_path / 'node2.log').read_text().splitlines() == [
        'echo node2 from 198.18.0.3', 'outside: ENETUNREACH'
    ]


_LOOKUP = r"""
import socket, sys
for address in sys.argv[1:]:
    where = (address, 0, 0, 0) if ':' in address else (address, 0)
    try:
        found = socket.getnameinfo(where, socket.NI_NAMEREQD)[0]
    except OSError as e:
        found = f'not found ({e.errno})'
    print(address, found, flush=True)
"""


@needs_netns
def test_nodes_find_each_other_by_name_and_nothing_else():
    """Issue 42: torch's TCPStore names each peer by a reverse lookup,
    which inside a node went to DNS servers it cannot reach, and every
    connection warned "[c10d] The hostname of the client socket cannot be
    retrieved. err=-3". Each node's hosts file answers for every node, as
    IPv4 and as the IPv4-mapped IPv6 address torchrun's store sees; any
    other address is still not found, and the files go with the cluster."""
    stream = io.StringIO()
    addresses = [
        '198.18.0.1', '::ffff:198.18.0.2', '::ffff:127.0.0.1', '198.18.0.9'
    ]
    with ec.EmulatedCluster(2) as cluster:
        files = [
            osp.join(ec.namespaces.NETNS_ETC, n.namespace, 'hosts')
            for n in cluster.nodes
        ]
        assert all(osp.isfile(f) for f in files)
        result = ec.run_on_nodes(
            cluster, [sys.executable, '-c', _LOOKUP] + addresses,
            port=12346,
            stream=stream,
            timeout=60)
    assert result.returncode == 0, stream.getvalue()
    found = {}
    for line in stream.getvalue().splitlines():
        node, address, name = line.split(' ', 2)
        found.setdefault(address, set()).add(name)
    assert found['198.18.0.1'] == {'node0'}
    assert found['::ffff:198.18.0.2'] == {'node1'}
    assert found['::ffff:127.0.0.1'] == {'localhost'}
    assert found['198.18.0.9'] == {'not found (-3)'}, found
    assert not any(osp.exists(f) or osp.exists(osp.dirname(f)) for f in files)


@needs_netns
def test_nodes_get_the_multi_node_environment():
    stream = io.StringIO()
    with ec.EmulatedCluster(2, ranks_per_node=3) as cluster:
        result = ec.run_on_nodes(
            cluster, 'echo $NNODES $NODE_RANK $MASTER_ADDR $PORT '
            '$GLOO_SOCKET_IFNAME $NPROC_PER_NODE',
            port=2345,
            stream=stream)
    assert result.returncode == 0
    assert sorted(stream.getvalue().splitlines()) == [
        '[node0] 2 0 198.18.0.1 2345 eth0 3',
        '[node1] 2 1 198.18.0.1 2345 eth0 3'
    ]


@needs_netns
def test_a_failing_node_stops_the_others_and_everything_goes(tmp_path):
    # node0 ignores SIGTERM and leaves a process in a session of its own
    # (as torchrun's workers are): SIGKILL and the namespace sweep get
    # them. node2 dies of SIGTERM. node1 fails once both are set up (a
    # fixed delay races a loaded machine's slow start).
    marker = _unique_seconds()
    up = tmp_path / 'up'
    command = (f'case $NODE_RANK in 0) trap "" TERM; setsid sleep {marker} &'
               f' touch {up}0; sleep {marker}; wait;; 1) for i in $(seq 600);'
               f' do [ -e {up}0 ] && [ -e {up}2 ] && exit 3; sleep 0.05;'
               f' done; exit 4;; *) touch {up}2; exec sleep {marker};; esac')
    start = time.monotonic()
    with ec.EmulatedCluster(3) as cluster:
        result = ec.run_on_nodes(cluster, command, grace=1)
        assert _sleeping(marker) == []
        names = set(cluster.namespaces)
    assert time.monotonic() - start < 15
    assert result.failed_node == 1
    assert result.returncode == 3
    assert result.returncodes == (-signal.SIGKILL, 3, -signal.SIGTERM)
    assert result.describe().startswith('node1 exited with code 3 after ')
    assert not names & netns_names()


def _wait_until(condition, seconds: float) -> float:
    """Seconds until ``condition()`` holds; fails after ``seconds``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds
        time.sleep(0.02)
    return time.monotonic() - start


@needs_netns
def test_nodes_end_with_their_maker_and_leftovers_go_once_idle(caplog):
    """A cluster whose process and keeper were both SIGKILLed: its nodes'
    commands end by themselves (their death signal), its namespaces stay.
    The next cluster removes them as one, and only once nothing runs in
    any of them: while something does, all stay, said once with the
    namespaces and pids. Never a live process's namespace."""
    seconds = _unique_seconds()
    child = subprocess.Popen([
        sys.executable, '-c', 'import sys\n'
        'from mmcv_custom.launching.emulated_cluster import '
        'EmulatedCluster, run_on_nodes\n'
        'with EmulatedCluster(2) as c:\n'
        '    print(c._keeper.pid, " ".join(c.namespaces), flush=True)\n'
        f'    run_on_nodes(c, ["sleep", "{seconds}"])\n'
    ],
                             cwd=ROOT,
                             stdout=subprocess.PIPE,
                             text=True)
    keeper, *names = child.stdout.readline().split()
    killed = set(names)
    live = f'mmcvc-{os.getpid()}-{secrets.token_hex(3)}-node0'
    sleeper = None
    try:
        _wait_until(lambda: len(_sleeping(seconds)) == 2, 10)
        os.kill(int(keeper), signal.SIGKILL)
        child.kill()
        child.wait()
        _wait_until(lambda: not _sleeping(seconds), 5)
        assert len(killed) == 3 and killed <= netns_names()
        _out('ip', 'netns', 'add', live)
        busy = sorted(killed)[1]  # a node
        sleeper = subprocess.Popen(
            ['ip', 'netns', 'exec', busy, 'sleep', seconds])
        _wait_until(lambda: len(_sleeping(seconds)) == 1, 5)
        with caplog.at_level('WARNING', logger=ec.__name__):
            for _ in range(2):
                with ec.EmulatedCluster(2):
                    pass
        assert killed | {live} <= netns_names()
        tag = sorted(killed)[0].rsplit('-', 1)[0]
        said = [r.getMessage() for r in caplog.records if tag in r.message]
        assert said == [
            'left the network namespaces of a killed cluster in place (its '
            f'process {child.pid} is gone, but processes still run in '
            f'them): {sorted(killed)[0]}, {busy} (pids {sleeper.pid}), '
            f'{sorted(killed)[2]}; once they end (kill {sleeper.pid}), the '
            'next cluster removes the namespaces'
        ]
        sleeper.kill()
        sleeper.wait()
        caplog.clear()
        with caplog.at_level('WARNING', logger=ec.__name__):
            with ec.EmulatedCluster(2):
                pass
        assert not killed & netns_names()
        assert live in netns_names()
        assert (
            'removed 3 network namespaces left by a killed run (its '
            f'process is gone): {", ".join(sorted(killed))}') in caplog.text
    finally:
        child.kill()
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        for name in killed | {live}:
            subprocess.run(['ip', 'netns', 'del', name], capture_output=True)


@needs_netns
def test_a_failure_while_creating_removes_what_was_made(monkeypatch):
    """The third node's veth fails: the switch and the first nodes, made
    already, go."""
    cluster = ec.EmulatedCluster(4, bandwidth_mbit=10)
    real_add_node = cluster._add_node

    def add_node(node):
        if node.rank == 2:
            run_command(['ip', 'link', 'add', 'name', 'x', 'type', 'no-such'])
        real_add_node(node)

    monkeypatch.setattr(cluster, '_add_node', add_node)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(
            ec.ClusterError,
            match=r'`ip link add name x type '
            r'no-such` failed with exit code \d+: '):
        with cluster:
            pass
    assert not set(cluster.namespaces) & netns_names()
    assert signal.getsignal(signal.SIGTERM) is handler
    assert not cluster.active


@pytest.mark.parametrize(
    'kwargs,error,message', [
        (dict(nodes=1), ValueError,
         'nodes should be an int from 2 to 1024 (one network namespace per '
         'node; a Linux bridge takes at most 1024 ports), but got 1'),
        (dict(nodes=True), TypeError, 'nodes should be an int, but got bool '
         'True'),
        (dict(nodes=2, bandwidth_mbit=-5), ValueError,
         'bandwidth_mbit should be a finite number of Mbit/s > 0, or None for '
         'links that are not shaped, but got -5'),
        (dict(nodes=2, bandwidth_mbit=1e-9), ValueError,
         "bandwidth_mbit should be from 0.002 to 600000 Mbit/s (what tc's tbf "
         'shapes as given), or None for links that are not shaped, but got '
         '1e-09'),
        (dict(nodes=2, bandwidth_mbit='100'), TypeError,
         "bandwidth_mbit should be a number of Mbit/s or None (not shaped), "
         "but got str '100'"),
        (dict(nodes=2, ranks_per_node=0), ValueError,
         'ranks_per_node should be an int >= 1 (ranks on each emulated '
         'node), but got 0'),
        (dict(nodes=2, ranks_per_node=2.0), TypeError,
         'ranks_per_node should be an int >= 1, but got float 2.0'),
    ],
    ids=[
        'one-node', 'bool', 'negative-rate', 'rate-tbf-cannot-hold',
        'rate-as-str', 'no-ranks', 'ranks-as-float'
    ])
def test_bad_cluster_arguments_are_refused_before_anything_is_made(
        kwargs, error, message):
    with pytest.raises(error) as raised:
        ec.EmulatedCluster(**kwargs)
    assert str(raised.value) == message


# The tool ----------------------------------------------------------------
@pytest.fixture
def tool_args(monkeypatch, capsys):
    """The tool's own ``parse_args``: exit code and last line of stderr."""
    return usage_errors(
        load_script(TOOL, '_emulated_cluster_tool'), TOOL, monkeypatch, capsys)


@pytest.mark.parametrize(
    'args,message', [
        (['--bandwidth', '-5', '--', 'true'
          ], 'argument --bandwidth: should be a rate in Mbit/s > 0, or 0 or '
         "\"unshaped\" for links that are not shaped, but got '-5'"),
        (['--bandwidth', 'fast', '--', 'true'
          ], 'argument --bandwidth: should be a rate in Mbit/s > 0, or 0 or '
         "\"unshaped\" for links that are not shaped, but got 'fast'"),
        (['--bandwidth', 'inf', '--', 'true'
          ], 'argument --bandwidth: should be a rate in Mbit/s > 0, or 0 or '
         "\"unshaped\" for links that are not shaped, but got 'inf'"),
        (['--bandwidth', '1e-9', '--', 'true'
          ], "argument --bandwidth: should be from 0.002 to 600000 Mbit/s "
         "(what tc's tbf shapes as given), or 0 or \"unshaped\" for links "
         "that are not shaped, but got '1e-9'"),
        (['--nodes', '1', '--', 'true'],
         '--nodes should be an int from 2 to 1024 (one network namespace per '
         'node), but got 1'),
        (['--nodes', 'two', '--', 'true'
          ], "argument --nodes: invalid int value: 'two'"),
        (['--bandwidth', '100'
          ], 'nothing to run: give the command to run on every node after -- '
         '(e.g. -- tools/dist_train.sh CONFIG 1), or --calibrate'),
        (['true'], 'unrecognized arguments: true (put the command to run on '
         'every node after --)'),
        (['--timeout', '0', '--', 'true'
          ], '--timeout should be > 0 seconds, but got 0'),
        (['--port', '70000', '--', 'true'
          ], '--port should be from 1 to 65535, but got 70000'),
        (['--log-dir', '/proc/no-such-dir', '--', 'true'
          ], '--log-dir /proc/no-such-dir: cannot create it (No such file or '
         'directory)'),
        (['--ranks-per-node', '0', '--', 'true'
          ], '--ranks-per-node should be an int >= 1 (ranks on each emulated '
         'node), but got 0'),
        (['--ranks-per-node', '1.5', '--', 'true'
          ], "argument --ranks-per-node: invalid int value: '1.5'"),
        (['--calibrate', '--link-bytes'
          ], '--link-bytes counts what the command after -- puts on the '
         'links, but no command was given'),
    ],
    ids=[
        'negative-rate', 'word-rate', 'infinite-rate', 'tiny-rate', 'one-node',
        'nodes-not-int', 'no-command', 'no-separator', 'timeout', 'port',
        'log-dir', 'no-ranks', 'ranks-not-int', 'link-bytes-no-command'
    ])
def test_bad_arguments_are_usage_errors(tool_args, args, message):
    assert tool_args(args) == (2, f'emulated_cluster.py: error: {message}')


def test_arguments_the_tool_accepts():
    tool = load_script(TOOL, '_emulated_cluster_tool')
    for word, rate in (('0', None), ('unshaped', None), ('2.5', 2.5)):
        args = tool.parse_args(['--bandwidth', word, '--', 'true'])
        assert args.bandwidth == rate
    # Everything after -- belongs to the command, options included.
    args = tool.parse_args([
        '--nodes', '3', '--', 'tools/dist_train.sh', 'x.py', '1', '--work-dir',
        'w', '--', 'y'
    ])
    assert args.nodes == 3 and args.bandwidth is None
    assert args.ranks_per_node == 1
    assert tool.parse_args(['--ranks-per-node', '4', '--',
                            'true']).ranks_per_node == 4
    assert args.command == [
        'tools/dist_train.sh', 'x.py', '1', '--work-dir', 'w', '--', 'y'
    ]
    assert tool.parse_args(['--calibrate']).command == []


# Run by torchrun on each node: an all-reduce inside each node, then one
# across all ranks, each 4 MiB of fp32, with what the node's link sent
# during each (read inside the node, as the benchmark does).
_TWO_LEVEL_PROBE = """
import os
import sys
import types

import torch
import torch.distributed as dist

# counters.py imports only the standard library (and .namespaces, which
# does too): loaded without mmcv_custom's __init__ (MMEngine and the rest,
# seconds for each rank on a shared machine).
package = types.ModuleType('emulated_cluster')
package.__path__ = [sys.argv[1]]
sys.modules['emulated_cluster'] = package
from emulated_cluster.counters import read_link_bytes  # noqa: E402


def sent():
    # Between two barriers: no rank of the node sends meanwhile.
    dist.barrier()
    counters = read_link_bytes(os.environ['GLOO_SOCKET_IFNAME'])
    dist.barrier()
    return counters


dist.init_process_group('gloo')
local = int(os.environ['LOCAL_WORLD_SIZE'])
node = int(os.environ['GROUP_RANK'])
groups = [
    dist.new_group(list(range(n * local, (n + 1) * local)))
    for n in range(dist.get_world_size() // local)
]
inside, across = torch.ones(2**20), torch.ones(2**20)
start = sent()
dist.all_reduce(inside, group=groups[node])
middle = sent()
dist.all_reduce(across)
end = sent() - middle
print(f"RESULT {node} {os.environ['LOCAL_RANK']} {dist.get_rank()} "
      f'{dist.get_world_size()} {(middle - start).tx} {end.tx} '
      f'{end.payload()} {inside[0]:g} {across[0]:g}', flush=True)
dist.destroy_process_group()
"""


@needs_tool
def test_ranks_of_a_node_talk_inside_it_and_only_the_rest_crosses(tmp_path):
    """2 nodes x 2 ranks through the tool, torchrun on each node with
    NPROC_PER_NODE ranks: torchrun numbers them as on a real cluster, an
    all-reduce inside each node leaves the node's link idle (its ranks
    talk through the node's loopback device), and one across all 4 ranks
    puts on each node's link what a ring all-reduce sends there."""
    probe = tmp_path / 'probe.py'
    probe.write_text(_TWO_LEVEL_PROBE)
    run = (f'{sys.executable} -m torch.distributed.run '
           '--nnodes $NNODES --node-rank $NODE_RANK --nproc-per-node '
           '$NPROC_PER_NODE --master-addr $MASTER_ADDR --master-port $PORT '
           f'{probe} {osp.dirname(ec.counters.__file__)}')
    proc = _tool('--nodes', '2', '--ranks-per-node', '2', '--timeout', '100',
                 '--', 'bash', '-c', run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'Emulated cluster: 2 nodes (2 ranks each' in proc.stdout
    # Two ranks of a node share its output: one line may hold both.
    rows = sorted(
        list(found)
        for found in re.findall(r'RESULT ' +
                                ' '.join([r'(\d+)'] * 9), proc.stdout))
    # Node, local rank, rank, world size: contiguous per node.
    assert [r[:4] for r in rows] == [['0', '0', '0',
                                      '4'], ['0', '1', '1', '4'],
                                     ['1', '0', '2', '4'],
                                     ['1', '1', '3', '4']]
    assert all(r[7:] == ['2', '4'] for r in rows)  # the sums
    # Each node finds its peers by name (issue 42): torch's store has
    # nothing to warn of (no log level is changed: its other warnings show).
    assert 'The hostname of the client socket cannot be retrieved' not in \
        proc.stdout + proc.stderr
    size = 2**20 * 4
    for _, _, _, _, inside, across, payload, _, _ in rows:
        # Barriers only: a few hundred bytes, no part of the 4 MiB.
        assert int(inside) < 0.01 * size
        # A ring over 4 ranks, numbered node by node, crosses each node's
        # link once per direction: 2 (P - 1) / P of the tensor, plus the
        # packets' headers and TCP's acknowledgements.
        assert int(across) == pytest.approx(2 * 3 / 4 * size, rel=0.03)
        # Less the headers, what TCP carried: the ring's bytes, gloo's
        # framing and the messages of torchrun's agents to their store
        # while the all-reduce runs (0.04% over the ring's bytes on an idle
        # machine, 0.3% at times, 1.1% once under the suite's load: the
        # longer the all-reduce takes, the more of them): never less than
        # the ring's bytes.
        ring = 2 * 3 / 4 * size
        assert ring <= int(payload) <= 1.03 * ring
        assert int(payload) >= 2 * 3 / 4 * size
    assert not _tool_namespaces(proc.stdout) & netns_names()


# Node 0 listens, node 1 connects and sends a megabyte, then both end.
_SEND_MB = r"""
import os, socket, time
port = int(os.environ['PORT'])
if os.environ['NODE_RANK'] == '0':
    server = socket.create_server(('0.0.0.0', port))
    conn, _ = server.accept()
    got = 0
    while chunk := conn.recv(65536):
        got += len(chunk)
    print('received', got, flush=True)
else:
    for _ in range(200):
        try:
            conn = socket.create_connection((os.environ['MASTER_ADDR'], port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    conn.sendall(bytes(10**6))
    conn.close()
"""


@needs_tool
def test_link_bytes_reports_what_crossed_each_nodes_link():
    """--link-bytes: after the command, each node's link counters over
    its run. Node 1's payload is the megabyte it sent, node 0's about 0
    (acknowledgements are all headers): within a few bytes on an idle
    machine, where frames whose headers are not a data segment's (the
    handshake's TCP options, ARP: -16 bytes in all, seen) are counted at
    66 bytes too; under load TCP adds options and the odd retransmission
    (824 bytes more once, in the suite), so the bound is 0.5%."""
    proc = _tool('--nodes', '2', '--link-bytes', '--timeout', '60', '--',
                 sys.executable, '-c', _SEND_MB)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '[node0] received 1000000' in proc.stdout
    assert ("emulated_cluster.py: bytes on each node's link while the "
            'command ran:') in proc.stdout
    found = {
        int(m[0]): [int(v) for v in m[1:]]
        for m in re.findall(
            r'^  node(\d) link: sent (\d+) B \(\d+\.\d{4} MiB\) in (\d+) '
            r'packets, payload (-?\d+) B \(-?\d+\.\d{4} MiB\); received '
            r'(\d+) B in (\d+) packets$', proc.stdout, re.M)
    }
    assert sorted(found) == [0, 1], proc.stdout
    sent, packets, payload, _, _ = found[1]
    assert sent == payload + ec.counters.HEADER_BYTES * packets
    assert -200 <= payload - 10**6 <= 5000
    assert found[0][3] >= 10**6  # node 0 received it
    assert abs(found[0][2]) <= 5000 and found[0][0] < 0.1 * 10**6
    assert not _tool_namespaces(proc.stdout) & netns_names()


@needs_tool
def test_tool_exits_with_the_failing_nodes_code_and_cleans_up(tmp_path):
    # Node 1 fails only once node 0 has printed: otherwise, on a loaded
    # machine, node 1 could exit before node 0's shell ran at all.
    up = tmp_path / 'node0-up'
    out = _tool(
        '--nodes', '2', '--bandwidth', '20', '--log-dir',
        str(tmp_path / 'logs'), '--', 'bash', '-c',
        f'echo started; if [ $NODE_RANK = 1 ]; then for i in $(seq 600); '
        f'do [ -e {up} ] && exit 5; sleep 0.05; done; exit 6; fi; '
        f'touch {up}; sleep 60')
    assert out.returncode == 5, out.stderr
    header = out.stdout.splitlines()
    assert header[0].startswith('Emulated cluster: 2 nodes on this host')
    assert re.match(
        r'  node0  198\.18\.0\.1 +eth0 in mmcvc-\S+-node0  '
        r'MASTER_ADDR, PORT=29500$', header[1])
    assert ('  links: 20 Mbit/s per node, each direction (tc tbf, burst '
            '64 KiB, queue 50 ms)') in header
    assert any(
        ln.startswith('  not emulated: propagation delay, jitter '
                      'and loss (no netem; rate only)') for ln in header)
    assert '[node1] started' in out.stdout
    assert re.fullmatch(
        r'emulated_cluster\.py: node1 exited with code 5 after \d+\.\d s; '
        r'stopped the other nodes; removed the cluster\n', out.stderr)
    assert (tmp_path / 'logs' / 'node0.log').read_text() == 'started\n'
    names = _tool_namespaces(out.stdout)
    assert len(names) == 3 and not names & netns_names()


@needs_tool
def test_tool_timeout_stops_everything_with_124():
    start = time.monotonic()
    out = _tool('--timeout', '1', '--', 'sleep', '60')
    assert out.returncode == 124, out.stderr
    assert time.monotonic() - start < 60
    assert re.fullmatch(
        r'emulated_cluster\.py: timed out after \d+\.\d s; '
        r'stopped all nodes; removed the cluster\n', out.stderr)
    names = _tool_namespaces(out.stdout)
    assert len(names) == 3 and not names & netns_names()


def _sleeping_nodes(command: str, marker: int, **popen):
    """The tool on 2 nodes, each running ``echo ready; <command>`` (a
    ``sleep <marker>``), once both nodes sleep; returns the process, its
    watchdog (kills it after 120 s; cancel it) and the lines so far."""
    proc = subprocess.Popen([
        sys.executable, TOOL, '--nodes', '2', '--', 'bash', '-c',
        f'echo ready; {command}'
    ],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True,
                            **popen)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    seen = []
    try:
        while sum('] ready' in ln for ln in seen) < 2:
            line = proc.stdout.readline()
            assert line, ''.join(seen) + proc.stderr.read()
            seen.append(line)
        # Each node's bash is starting (or exec-ing) its sleep.
        _wait_until(lambda: len(_sleeping(marker)) == 2, 10)
    except BaseException:
        watchdog.cancel()
        proc.kill()
        raise
    return proc, watchdog, seen


@needs_tool
@pytest.mark.parametrize(
    'signum,code,words', [
        (signal.SIGINT, 130, 'interrupted (SIGINT)'),
        (signal.SIGTERM, 143, 'interrupted by SIGTERM'),
    ],
    ids=['sigint', 'sigterm'])
def test_tool_signal_stops_everything(signum, code, words):
    marker = _unique_seconds()
    proc, watchdog, seen = _sleeping_nodes(f'exec sleep {marker}', marker)
    try:
        proc.send_signal(signum)
        rest, err = proc.communicate(timeout=60)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == code, err
    assert err == (f'emulated_cluster.py: {words}: stopped every node and '
                   'removed the cluster\n')
    assert _sleeping(marker) == []
    names = _tool_namespaces(''.join(seen))
    assert len(names) == 3 and not names & netns_names()


@needs_tool
def test_a_killed_tools_nodes_and_namespaces_go_with_it():
    """``kill -9`` of the tool's whole process group (a closed terminal,
    a scheduler's hard stop): its keeper stops what runs on the nodes and
    removes every namespace within seconds, and says so."""
    marker = _unique_seconds()
    proc, watchdog, seen = _sleeping_nodes(
        f'sleep {marker}; echo not reached', marker, start_new_session=True)
    try:
        names = _tool_namespaces(''.join(seen))
        assert len(names) == 3 and names <= netns_names()
        os.killpg(proc.pid, signal.SIGKILL)
        took = _wait_until(
            lambda: not _sleeping(marker) and not names & netns_names(), 10)
        # The keeper's line, once its work is done (it holds stderr).
        rest, err = proc.communicate(timeout=30)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert 'not reached' not in rest
    # The nodes' hosts files went with them.
    assert not any(
        osp.exists(osp.join(ec.namespaces.NETNS_ETC, n)) for n in names)
    # Each node's bash and sleep, less those their death signal ended.
    tag = sorted(names)[0].rsplit('-', 1)[0]
    assert re.fullmatch(
        re.escape('mmcv_custom.emulated_cluster: the process that made '
                  f'emulated cluster {tag} (pid {proc.pid}) ended without '
                  'removing it: stopped ') + '[2-4]' +
        re.escape(' processes in its nodes and removed '
                  f'{", ".join(sorted(names))}') + '\n', err), err
    print(f'nodes and namespaces gone {took:.2f} s after the SIGKILL')


@needs_tool
def test_calibration_measures_a_gloo_all_reduce():
    # 4 MiB at 100 Mbit/s: about 0.35 s an all_reduce on 2 nodes.
    out = _tool('--nodes', '2', '--bandwidth', '100', '--calibrate',
                '--calibrate-mib', '4', '--calibrate-iters', '3', '--timeout',
                '120')
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(
        r'calibration: gloo all_reduce of 4 MiB fp32, 2 ranks \(one per '
        r'node\), median of 3: (\d+\.\d+) s, bus bandwidth (\d+\.\d) '
        r'Mbit/s = (\d+\.\d\d) x the set 100 Mbit/s', out.stdout)
    assert found, out.stdout
    seconds, busbw, ratio = map(float, found.groups())
    # A shared machine: no tight bounds, but the shaping must show.
    assert 0 < busbw < 150
    assert ratio == pytest.approx(busbw / 100, abs=0.01)
    assert busbw == pytest.approx(4 * 2**20 * 8 / seconds / 1e6, rel=0.02)
    assert not _tool_namespaces(out.stdout) & netns_names()


# Without root ----------------------------------------------------------
_AS_NOBODY = r'''
import importlib.util, os, sys
# The package alone, without mmcv_custom (torch, MMEngine), as a bare
# python3 would load it.
package = os.path.dirname(sys.argv[1])
spec = importlib.util.spec_from_file_location(
    '_ec', sys.argv[1], submodule_search_locations=[package])
ec = importlib.util.module_from_spec(spec)
sys.modules['_ec'] = ec
spec.loader.exec_module(ec)
if os.geteuid() != 0:
    try:
        ec.reexec_in_user_namespace([sys.executable] + sys.argv)
    except ec.ClusterUnavailable as e:
        print(e)
        sys.exit(1)
with ec.EmulatedCluster(2, bandwidth_mbit=10) as cluster:
    print('\n'.join(cluster.describe()))
    result = ec.run_on_nodes(cluster, 'id -u; tc qdisc show dev eth0',
                             stream=sys.stdout)
sys.exit(result.returncode)
'''


@pytest.fixture
def as_nobody():
    """Run the library as uid 65534 with an interpreter that user can
    run; skip where there is none or no ``setpriv``."""
    if os.geteuid() != 0 or shutil.which('setpriv') is None:
        pytest.skip('needs root and setpriv to become another user')
    folder = tempfile.mkdtemp(prefix='mmcvc-test-')
    try:
        os.chmod(folder, 0o755)
        script = osp.join(folder, 'as_nobody.py')
        with open(script, 'w') as f:
            f.write(_AS_NOBODY)
        os.chmod(script, 0o644)
        become = [
            shutil.which('setpriv'), '--reuid=65534', '--regid=65534',
            '--clear-groups'
        ]
        # One it may run in a user namespace too (the module needs only
        # the standard library).
        python = next(
            (p for p in (sys.executable, '/usr/bin/python3') if subprocess.run(
                become + ['unshare', '--user', '--map-root-user', p, '-c', ''],
                cwd=folder,
                capture_output=True).returncode == 0), None)
        if python is None:
            pytest.skip('no Python that uid 65534 may run')

        def run(env=None):
            return subprocess.run(
                become + [python, script, ec.__file__],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=60)

        run.folder = folder  # readable by that user
        yield run
    finally:
        shutil.rmtree(folder)


def test_without_root_it_runs_in_a_user_namespace(as_nobody):
    if ec.check_user_namespace() is not None:
        pytest.skip(ec.check_user_namespace())
    out = as_nobody()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == ('  (not root: inside an unprivileged user '
                        'namespace, with a private /run/netns)')
    for rank in (0, 1):
        assert f'[node{rank}] 0' in lines  # root of the user namespace
    assert sum('rate 10Mbit' in ln for ln in lines) == 2
    # Without unshare, one line says what was tried and why it failed.
    bin_dir = osp.join(as_nobody.folder, 'bin')
    os.mkdir(bin_dir)
    for tool in ('ip', 'tc', 'sh'):
        os.symlink(shutil.which(tool), osp.join(bin_dir, tool))
    out = as_nobody(env=dict(os.environ, PATH=bin_dir))
    assert out.returncode == 1
    assert out.stdout == (
        'cannot create network namespaces: not root (uid 65534), and an '
        'unprivileged user namespace needs util-linux and iproute2 '
        '(unshare not found on PATH)\n')


# End to end --------------------------------------------------------------
# The FCN on a small toy set, a checkpoint at the end.
_TINY = [
    'default_hooks.logger.interval=1', 'train_cfg.val_interval=100',
    'default_hooks.checkpoint.interval=2', 'comm_hook.type=bf16_compress'
] + toy_set(16, 8)


@needs_tool
@pytest.mark.slow
def test_two_node_training_and_resume_through_the_tool(tmp_path):
    """tools/dist_train.sh on 2 emulated nodes at 300 Mbit/s, one rank
    each: 2 iterations with a checkpoint, then resumed to 4."""
    env = dict(os.environ, PYTHON=sys.executable)

    def train(iters, *extra):
        return _tool(
            '--nodes',
            '2',
            '--bandwidth',
            '300',
            '--timeout',
            '300',
            '--',
            osp.join(ROOT, 'tools', 'dist_train.sh'),
            FCN,
            '1',
            '--work-dir',
            'work',
            *extra,
            '--cfg-options',
            f'train_cfg.max_iters={iters}',
            *_TINY,
            cwd=str(tmp_path),
            env=env,
            timeout=360)

    first = train(2)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    log = first.stdout
    # One rank on each node, both in the gloo group of 2.
    assert re.search(
        r"\[node0\] .*Registered DDP communication hook on "
        r"MMDistributedDataParallel: type='bf16_compress' .*"
        r'process group: 2 ranks, backend gloo', log), log
    assert re.search(r'\[node0\] .*Iter\(train\) \[2/2\]', log)
    assert (tmp_path / 'work' / 'iter_2.pth').is_file()

    resumed = train(4, '--resume')
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    log = resumed.stdout
    assert 'resumed epoch: 0, iter: 2' in log
    assert 'process group: 2 ranks, backend gloo' in log
    assert re.search(r'\[node0\] .*Iter\(train\) \[4/4\]', log)
    assert not re.search(r'Iter\(train\) \[[12]/4\]', log)
    assert (tmp_path / 'work' / 'iter_4.pth').is_file()
    for out in (first, resumed):
        assert not _tool_namespaces(out.stdout) & netns_names()


# The files run as programs -------------------------------------------------
@pytest.mark.parametrize('module',
                         ['namespaces', 'node_start', 'calibration_rank'])
def test_program_files_run_alone(module):
    """The keeper, a node's first program and a calibration rank run these
    files by path: without ``site`` (so neither mmcv_custom nor torch can
    be imported) each still starts, and without its arguments says it is a
    library."""
    path = osp.join(osp.dirname(ec.__file__), f'{module}.py')
    done = subprocess.run([sys.executable, '-P', '-S', path],
                          capture_output=True,
                          text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith('this module is a library; run '
                                  'tools/emulated_cluster.py')
