"""Running one command on every node of an open cluster at once, with the
multi-node environment, and stopping them all as soon as one fails.
"""
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO, Dict, List, Optional, Sequence, Tuple, Union

from . import node_start
from .cluster import EmulatedCluster, Node
from .namespaces import kill_namespace_pids, namespace_pids
from .node_start import NODE_FLAG, signal_exit_code
from .programs import program_argv

__all__ = [
    'DEFAULT_PORT', 'TIMEOUT_EXIT_CODE', 'NodesFailed', 'RunResult',
    'run_on_nodes'
]

_LOG = logging.getLogger(__name__)

#: ``PORT`` when none is given; each node has its own ports, so it never
#: clashes with the host's or another cluster's.
DEFAULT_PORT = 29500
#: The exit code of a run stopped by its timeout, as timeout(1) uses.
TIMEOUT_EXIT_CODE = 124


class NodesFailed(RuntimeError):
    """A run on the nodes failed or timed out; ``result`` says which node
    and how (a :class:`RunResult`)."""

    def __init__(self, message: str, result: 'RunResult'):
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class RunResult:
    """How a :func:`run_on_nodes` ended.

    Attributes:
        returncodes (tuple): Each node's exit code as ``Popen`` reports it
            (negative: killed by that signal, e.g. after another node
            failed).
        failed_node (int, optional): The first node seen to exit non-zero;
            None if none did.
        timed_out (bool): Whether the timeout stopped the run.
        elapsed (float): Seconds from start to the last node's exit.
    """
    returncodes: Tuple[Optional[int], ...]
    failed_node: Optional[int]
    timed_out: bool
    elapsed: float

    @property
    def returncode(self) -> int:
        """A shell's exit code for the run: the failed node's (``128 + N``
        when signal N killed it), :data:`TIMEOUT_EXIT_CODE` for a timeout,
        else 0."""
        if self.failed_node is not None:
            code = self.returncodes[self.failed_node]
            return signal_exit_code(-code) if code < 0 else code
        return TIMEOUT_EXIT_CODE if self.timed_out else 0

    def describe(self) -> str:
        """One line saying how the run ended."""
        if self.failed_node is not None:
            code = self.returncodes[self.failed_node]
            how = (f'was killed by {signal.Signals(-code).name}'
                   if code < 0 else f'exited with code {code}')
            return (f'node{self.failed_node} {how} after '
                    f'{self.elapsed:.1f} s; stopped the other nodes')
        if self.timed_out:
            return (f'timed out after {self.elapsed:.1f} s; stopped all '
                    'nodes')
        return (f'all {len(self.returncodes)} nodes exited with code 0 '
                f'after {self.elapsed:.1f} s')


def _node_env(cluster: EmulatedCluster, node: Node, port: int,
              env: Optional[Dict[str, str]]) -> Dict[str, str]:
    merged = dict(os.environ if env is None else env)
    # Prefixed lines are only useful when they arrive as they are written.
    merged.setdefault('PYTHONUNBUFFERED', '1')
    # The nodes share this machine's cores, and torchrun leaves a node of
    # one rank all of them: the nodes' OpenMP threads would oversubscribe
    # the cores and spin (FCN toy runs of one rank a node took 10-20x as
    # long, erratically). Each rank gets its share; a user's setting wins.
    merged.setdefault(
        'OMP_NUM_THREADS',
        str(
            max(1, (os.cpu_count() or 1) //
                (cluster.num_nodes * cluster.ranks_per_node))))
    merged.update(
        NNODES=str(cluster.num_nodes),
        NODE_RANK=str(node.rank),
        MASTER_ADDR=cluster.master_addr,
        PORT=str(port),
        MASTER_PORT=str(port),
        NPROC_PER_NODE=str(cluster.ranks_per_node),
        GLOO_SOCKET_IFNAME=node.interface)
    return merged


def _pump(node: int, pipe: IO[bytes], stream: Optional[IO[str]],
          log: Optional[IO[bytes]], lock: threading.Lock) -> None:
    """Copy a node's output line by line to ``stream`` (prefixed) and
    ``log`` (as it is) until the node closes it."""
    try:
        for raw in iter(pipe.readline, b''):
            if log is not None:
                log.write(raw)
                log.flush()
            if stream is not None:
                text = raw.decode('utf-8', 'replace').rstrip('\r\n')
                with lock:
                    stream.write(f'[node{node}] {text}\n')
                    stream.flush()
    finally:
        pipe.close()
        if log is not None:
            log.close()


def _killpg(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: List[subprocess.Popen], cluster: EmulatedCluster,
          grace: float) -> None:
    """SIGTERM every node's process group and every process left in the
    nodes; SIGKILL what remains after ``grace`` seconds.

    Process groups alone are not enough: torchrun starts its workers in
    sessions of their own (and forwards SIGTERM to them itself), and a
    command may leave daemons behind; whatever is in a node's namespace
    was started there by us, so it is all stopped."""
    namespaces = [n.namespace for n in cluster.nodes]
    for proc in procs:
        if proc.poll() is None:
            _killpg(proc, signal.SIGTERM)
    groups = [proc.pid for proc in procs]
    for ns in namespaces:
        kill_namespace_pids(ns, signal.SIGTERM, spare_groups=groups)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs) and not any(
                namespace_pids(ns) for ns in namespaces):
            break
        time.sleep(0.1)
    else:
        for proc in procs:
            if proc.poll() is None:
                _killpg(proc, signal.SIGKILL)
        for ns in namespaces:
            kill_namespace_pids(ns, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (D state)
            _LOG.warning('process %d did not exit after SIGKILL', proc.pid)


def _start_on_node(cluster: EmulatedCluster, node, argv: List[str], port: int,
                   env: Optional[Dict[str, str]], log_dir: Optional[str],
                   stream: Optional[IO[str]], lock: threading.Lock):
    """Start ``argv`` in ``node``'s namespace, in a session of its own,
    ending with this process (see :func:`_node_argv`), and a thread
    pumping its output to ``stream`` and its log."""
    log = (
        open(os.path.join(log_dir, f'node{node.rank}.log'), 'wb')
        if log_dir is not None else None)
    try:
        proc = subprocess.Popen(
            _node_argv(node.namespace, argv),
            env=_node_env(cluster, node, port, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True)
    except BaseException:
        if log is not None:
            log.close()
        raise
    pump = threading.Thread(
        target=_pump,
        args=(node.rank, proc.stdout, stream, log, lock),
        name=f'node{node.rank}-output',
        daemon=True)
    pump.start()
    return proc, pump


def _node_argv(namespace: str, argv: List[str]) -> List[str]:
    """``ip netns exec NAMESPACE ARGV``, started through
    :mod:`.node_start`, which sets the process's parent-death signal first
    (SIGTERM, kept through ``exec``): a node's command ends as soon as the
    process that started it does, SIGKILL included, before the cluster's
    keeper sweeps the rest."""
    return program_argv(node_start.__file__, NODE_FLAG, str(os.getpid()), '--',
                        'ip', 'netns', 'exec', namespace) + argv


def _wait_for_nodes(procs: List[subprocess.Popen], start: float,
                    timeout: Optional[float]) -> Tuple[Optional[int], bool]:
    """Wait until every node exited, one failed or ``timeout`` passed since
    ``start``; ``(first failed node or None, whether it timed out)``."""
    while True:
        codes = [p.poll() for p in procs]
        failed = next(
            (i for i, c in enumerate(codes) if c is not None and c != 0), None)
        if failed is not None or all(c is not None for c in codes):
            return failed, False
        if timeout is not None and time.monotonic() - start > timeout:
            return None, True
        time.sleep(0.05)


def run_on_nodes(cluster: EmulatedCluster,
                 command: Union[str, Sequence[str]],
                 *,
                 port: int = DEFAULT_PORT,
                 env: Optional[Dict[str, str]] = None,
                 timeout: Optional[float] = None,
                 log_dir: Optional[str] = None,
                 stream: Optional[IO[str]] = None,
                 grace: float = 5.0) -> RunResult:
    """Run ``command`` on every node at once and wait for all of them.

    Each node runs it in its namespace (``ip netns exec``), in a session
    of its own, with stdin closed and the environment ``env`` (default:
    this process's) plus ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` (node
    0's address), ``PORT`` and ``MASTER_PORT`` (``port``),
    ``NPROC_PER_NODE`` (the cluster's ``ranks_per_node``: what to give
    ``dist_train.sh`` or torchrun's ``--nproc-per-node``),
    ``GLOO_SOCKET_IFNAME`` (the node's interface; gloo would otherwise
    resolve the hostname, which all nodes share) and, unless set,
    ``PYTHONUNBUFFERED=1``. These are what ``tools/dist_train.sh`` and
    ``tools/dist_test.sh`` read for a multi-node torchrun job. The ranks
    torchrun starts on a node bind that interface's address; between
    themselves they talk through the node's loopback device, so only
    traffic between nodes crosses the shaped link.

    As soon as one node exits non-zero, or ``timeout`` passes, or this
    process is interrupted (Ctrl-C, or :class:`Interrupted` inside an
    open cluster), the other nodes get SIGTERM (their whole process
    groups, and every process left in their namespaces), then SIGKILL
    after ``grace`` seconds. When this returns or raises, no process is
    left in any node, including daemons a successful command left
    behind: the nodes are clean for the next run.

    Args:
        cluster (EmulatedCluster): An open cluster.
        command (str | Sequence[str]): A string is run by ``bash -c``
            (so ``$NODE_RANK`` expands on each node); a sequence is run
            as it is.
        port (int): ``PORT``. Defaults to :data:`DEFAULT_PORT`.
        env (dict, optional): The base environment. Defaults to None,
            meaning ``os.environ``.
        timeout (float, optional): Seconds before every node is stopped.
            Defaults to None: no limit.
        log_dir (str, optional): When given, node ``i``'s output also goes
            to ``log_dir/node{i}.log`` (created if needed).
        stream (IO[str], optional): Where each output line goes, prefixed
            with ``[node{i}] ``. Defaults to None: only to the logs.
        grace (float): Seconds between SIGTERM and SIGKILL. Defaults to 5.

    Returns:
        RunResult: Each node's exit code, the first that failed, whether
        it timed out.

    Raises:
        KeyboardInterrupt, Interrupted: After stopping every node.
    """
    if not cluster.active:
        raise RuntimeError('run_on_nodes needs an open EmulatedCluster '
                           '(inside its `with` block)')
    if isinstance(
            port,
            bool) or not isinstance(port, int) or not (1 <= port <= 65535):
        raise ValueError(f'port should be an int from 1 to 65535, but got '
                         f'{port!r}')
    if timeout is not None and not timeout > 0:
        raise ValueError(f'timeout should be > 0 seconds or None, but got '
                         f'{timeout!r}')
    argv = (['bash', '-c', command]
            if isinstance(command, str) else list(command))
    if not argv:
        raise ValueError('command should not be empty')
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    lock = threading.Lock()
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    start = time.monotonic()
    try:
        for node in cluster.nodes:
            proc, pump = _start_on_node(cluster, node, argv, port, env,
                                        log_dir, stream, lock)
            procs.append(proc)
            pumps.append(pump)
        failed, timed_out = _wait_for_nodes(procs, start, timeout)
        elapsed = time.monotonic() - start
    finally:
        # Also on Ctrl-C and Interrupted: nothing may outlive the call.
        _stop(procs, cluster, grace)
        for pump in pumps:
            pump.join(timeout=5)
    return RunResult(
        returncodes=tuple(p.returncode for p in procs),
        failed_node=failed,
        timed_out=timed_out,
        elapsed=elapsed)
