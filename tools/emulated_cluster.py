"""Run a command on emulated cluster nodes: one host, shaped links.

Creates ``--nodes`` network namespaces on this host, joined by a bridge,
each node's link shaped to ``--bandwidth`` Mbit/s in both directions with
tc's token bucket (tbf); runs the command after ``--`` on every node at
once with ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``PORT`` and
``GLOO_SOCKET_IFNAME`` set (what ``tools/dist_train.sh`` and
``tools/dist_test.sh`` read for a multi-node torchrun job), and
``NPROC_PER_NODE`` (``--ranks-per-node``: the ranks each node's launcher
should start; they share the node's namespace and talk to each other
through its loopback device, so only traffic between nodes crosses the
shaped link, as between the GPUs of a real node); prints each
node's output prefixed with ``[node<i>]``; removes everything on exit. Only
the rate is emulated: no propagation delay, jitter or loss, and all nodes
share this host's CPUs (see :mod:`mmcv_custom.launching.emulated_cluster`).

Needs root, or unprivileged user namespaces (then it re-executes itself in
one). Exit code: the first failing node's, 124 after ``--timeout``, 130 on
Ctrl-C (143 on SIGTERM), 2 for usage errors, 1 when the cluster cannot be
made. c10d may warn "The hostname of the client socket cannot be
retrieved": the nodes' addresses have no names, which is harmless.

Examples:
    # 2 nodes at 300 Mbit/s, one rank each, training the demo's FCN
    python tools/emulated_cluster.py --nodes 2 --bandwidth 300 -- \\
        tools/dist_train.sh \\
        configs/fcn/fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py 1 \\
        --work-dir work_dirs/fcn_2nodes_300mbit
    # 2 nodes x 2 ranks: torchrun starts NPROC_PER_NODE ranks per node
    python tools/emulated_cluster.py --nodes 2 --ranks-per-node 2 \
        --bandwidth 300 -- bash -c 'tools/dist_train.sh \
        configs/fcn/fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py \
        $NPROC_PER_NODE --work-dir work_dirs/fcn_2x2_300mbit'
    # the bytes each node's link carried while the command ran
    python tools/emulated_cluster.py --nodes 2 --link-bytes -- \
        bash -c 'echo $NODE_RANK'
    # what a gloo all_reduce gets through 100 Mbit/s links
    python tools/emulated_cluster.py --nodes 2 --bandwidth 100 --calibrate
    # any command; a shell expands $NODE_RANK on each node
    python tools/emulated_cluster.py --nodes 3 -- bash -c 'echo $NODE_RANK'
"""
import argparse
import math
import os
import signal
import sys
import time

from mmcv_custom.launching.emulated_cluster.availability import (
    ClusterUnavailable, reexec_in_user_namespace)
from mmcv_custom.launching.emulated_cluster.calibrate import calibrate
from mmcv_custom.launching.emulated_cluster.cluster import (EmulatedCluster,
                                                            Interrupted)
from mmcv_custom.launching.emulated_cluster.counters import (
    HEADER_BYTES, namespace_link_bytes)
from mmcv_custom.launching.emulated_cluster.namespaces import ClusterError
from mmcv_custom.launching.emulated_cluster.node_options import (
    add_node_options, check_node_options)
from mmcv_custom.launching.emulated_cluster.node_start import signal_exit_code
from mmcv_custom.launching.emulated_cluster.run import (DEFAULT_PORT,
                                                        TIMEOUT_EXIT_CODE,
                                                        NodesFailed,
                                                        run_on_nodes)
from mmcv_custom.launching.emulated_cluster.shaping import (MAX_RATE_MBIT,
                                                            MIN_RATE_MBIT)

PROG = 'emulated_cluster.py'
_UNSHAPED = 'unshaped'


def _bandwidth(value: str):
    """``--bandwidth``: Mbit/s, None for 0 or 'unshaped'."""
    if value.strip().lower() == _UNSHAPED:
        return None
    try:
        mbit = float(value)
    except ValueError:
        mbit = math.nan
    if not (math.isfinite(mbit) and mbit >= 0):
        raise argparse.ArgumentTypeError(
            'should be a rate in Mbit/s > 0, or 0 or "unshaped" for links '
            f'that are not shaped, but got {value!r}')
    if mbit and not MIN_RATE_MBIT <= mbit <= MAX_RATE_MBIT:
        raise argparse.ArgumentTypeError(
            f'should be from {MIN_RATE_MBIT:g} to {MAX_RATE_MBIT:g} Mbit/s '
            "(what tc's tbf shapes as given), or 0 or \"unshaped\" for "
            f'links that are not shaped, but got {value!r}')
    return mbit or None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        usage=f'{PROG} [options] [--calibrate] [-- COMMAND [ARG ...]]',
        epilog='COMMAND runs on every node as it is (no shell: use '
        "`bash -c '...'` for one). Only the link rate is emulated; "
        'propagation delay, jitter and loss are not.')
    add_node_options(
        parser,
        ranks_per_node_help='ranks on each node, an int >= 1, set as '
        'NPROC_PER_NODE on every node for its launcher (e.g. '
        '`tools/dist_train.sh CONFIG $NPROC_PER_NODE`); ranks of a node '
        'talk inside it, only traffic between nodes crosses the shaped '
        'link (default: 1)')
    parser.add_argument(
        '--bandwidth',
        type=_bandwidth,
        default=None,
        metavar='MBIT',
        help='each node\'s link rate in Mbit/s, each direction; 0 or '
        '"unshaped" (the default) for links that are not shaped')
    parser.add_argument(
        '--port',
        type=int,
        default=DEFAULT_PORT,
        help=f'PORT on every node (default: {DEFAULT_PORT}; each node has '
        'its own ports, so it clashes with nothing on this host)')
    parser.add_argument(
        '--timeout',
        type=float,
        default=None,
        metavar='SEC',
        help=f'stop every node and exit {TIMEOUT_EXIT_CODE} after SEC '
        'seconds (calibration included)')
    parser.add_argument(
        '--grace',
        type=float,
        default=5.0,
        metavar='SEC',
        help='seconds between SIGTERM and SIGKILL when stopping nodes '
        '(default: 5)')
    parser.add_argument(
        '--log-dir',
        metavar='DIR',
        help='also write node i\'s output to DIR/node<i>.log')
    parser.add_argument(
        '--link-bytes',
        action='store_true',
        help="after the command, print what each node's link sent and "
        'received while it ran, from the interface counters: bytes, '
        f'packets, and the payload (bytes less {HEADER_BYTES} of headers a '
        'packet: what TCP carried for the ranks). Traffic between the '
        'ranks of one node is not on it')
    parser.add_argument(
        '--calibrate',
        action='store_true',
        help='first measure a gloo all_reduce across the nodes (one rank '
        'each, whatever --ranks-per-node: it measures the links) and '
        'print its bus bandwidth against --bandwidth')
    parser.add_argument(
        '--calibrate-mib',
        type=float,
        default=16.0,
        metavar='MIB',
        help='fp32 tensor size for --calibrate (default: 16)')
    parser.add_argument(
        '--calibrate-iters',
        type=int,
        default=5,
        metavar='N',
        help='timed all_reduces for --calibrate, after 2 untimed ones; the '
        'median is reported (default: 5)')
    return parser


def parse_args(args=None) -> argparse.Namespace:
    """Parse the options before ``--``; the words after it are
    ``command``."""
    parser = _build_parser()
    args = sys.argv[1:] if args is None else list(args)
    if '--' in args:
        split = args.index('--')
        args, command = args[:split], args[split + 1:]
    else:
        command = []
    parsed, extra = parser.parse_known_args(args)
    if extra:
        parser.error(f'unrecognized arguments: {" ".join(extra)} (put the '
                     'command to run on every node after --)')
    parsed.command = command
    check_node_options(parser, parsed)
    if not 1 <= parsed.port <= 65535:
        parser.error(f'--port should be from 1 to 65535, but got '
                     f'{parsed.port}')
    if parsed.timeout is not None and not parsed.timeout > 0:
        parser.error(f'--timeout should be > 0 seconds, but got '
                     f'{parsed.timeout:g}')
    if not parsed.grace >= 0:
        parser.error(f'--grace should be >= 0 seconds, but got '
                     f'{parsed.grace:g}')
    if not (math.isfinite(parsed.calibrate_mib) and parsed.calibrate_mib > 0):
        parser.error(f'--calibrate-mib should be > 0, but got '
                     f'{parsed.calibrate_mib:g}')
    if parsed.calibrate_iters < 1:
        parser.error(f'--calibrate-iters should be >= 1, but got '
                     f'{parsed.calibrate_iters}')
    if parsed.log_dir is not None:
        # Now, not after the cluster is up.
        try:
            os.makedirs(parsed.log_dir, exist_ok=True)
        except OSError as e:
            parser.error(f'--log-dir {parsed.log_dir}: cannot create it '
                         f'({e.strerror})')
    if parsed.link_bytes and not command:
        parser.error('--link-bytes counts what the command after -- puts '
                     'on the links, but no command was given')
    if not command and not parsed.calibrate:
        parser.error('nothing to run: give the command to run on every '
                     'node after -- (e.g. -- tools/dist_train.sh CONFIG 1), '
                     'or --calibrate')
    return parsed


def _fail(message: str) -> None:
    print(f'{PROG}: {message}', file=sys.stderr, flush=True)


def _links(cluster: EmulatedCluster) -> list:
    return [
        namespace_link_bytes(n.namespace, n.interface) for n in cluster.nodes
    ]


def _link_lines(before: list, after: list) -> list:
    """One line per node: what its link carried between the two reads,
    in bytes (exact, for differences between runs) and MiB (the unit of
    ``comm_MB``)."""
    lines = []
    for rank, (start, end) in enumerate(zip(before, after)):
        moved = end - start
        lines.append(
            f'  node{rank} link: sent {moved.tx} B ({moved.tx / 2**20:.4f} '
            f'MiB) in {moved.tx_packets} packets, payload {moved.payload()} '
            f'B ({moved.payload() / 2**20:.4f} MiB); received {moved.rx} B '
            f'in {moved.rx_packets} packets')
    return lines


def _run(args: argparse.Namespace) -> int:
    start = time.monotonic()

    def remaining():
        if args.timeout is None:
            return None
        return max(args.timeout - (time.monotonic() - start), 1e-3)

    with EmulatedCluster(args.nodes, args.bandwidth,
                         args.ranks_per_node) as cluster:
        print('\n'.join(cluster.describe(args.port)), flush=True)
        if args.calibrate:
            result = calibrate(
                cluster,
                size_mib=args.calibrate_mib,
                iters=args.calibrate_iters,
                port=args.port,
                timeout=remaining())
            print(f'  {result.describe()}', flush=True)
        if not args.command:
            return 0
        before = _links(cluster) if args.link_bytes else None
        result = run_on_nodes(
            cluster,
            args.command,
            port=args.port,
            timeout=remaining(),
            log_dir=args.log_dir,
            stream=sys.stdout,
            grace=args.grace)
        if before is not None:
            print(
                f'{PROG}: bytes on each node\'s link while the command ran:',
                flush=True)
            print('\n'.join(_link_lines(before, _links(cluster))), flush=True)
    if result.returncode:
        _fail(f'{result.describe()}; removed the cluster')
    else:
        print(f'{PROG}: {result.describe()}', flush=True)
    return result.returncode


def main() -> int:
    args = parse_args()
    # Ctrl-C must reach us even when started with SIGINT ignored (e.g. as
    # a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.geteuid() != 0:
        try:
            reexec_in_user_namespace([sys.executable] + sys.argv)
        except ClusterUnavailable as e:
            _fail(str(e))
            return 1
    try:
        return _run(args)
    except NodesFailed as e:
        _fail(f'{e}')
        return e.result.returncode
    except KeyboardInterrupt:
        _fail('interrupted (SIGINT): stopped every node and removed the '
              'cluster')
        return signal_exit_code(signal.SIGINT)
    except Interrupted as e:
        _fail(f'{e}: stopped every node and removed the cluster')
        return signal_exit_code(e.signum)
    except (ClusterUnavailable, ClusterError) as e:
        _fail(str(e))
        return 1


if __name__ == '__main__':
    sys.exit(main())
