"""TCP ports for the runs the tools and tests start themselves.

Each run rendezvous on a port of its own, so that runs on one host never
meet: a free one (:func:`free_port`), or the ``PORT`` the user set, checked
before any run starts (:func:`rendezvous_port`).
"""
import errno
import os
import re
import socket
from typing import Mapping, Optional

__all__ = ['free_port', 'rendezvous_port']


def free_port() -> str:
    """A TCP port free on this host now, as ``PORT`` for
    ``tools/dist_train.sh`` (each run its own, so runs never meet)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return str(s.getsockname()[1])


def _bind_error(port: int) -> Optional[OSError]:
    """Why a rendezvous store could not listen on ``port`` here now; None
    if it could. Bound as torch's TCPStore binds (every address, with
    ``SO_REUSEADDR``), so a port another process listens on is taken, and
    one the previous run of the same tool left in TIME_WAIT is not."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(('', port))
        except OSError as e:
            return e
    return None


def rendezvous_port(parser,
                    environ: Optional[Mapping[str,
                                              str]] = None) -> Optional[str]:
    """The ``PORT`` the tool's runs rendezvous on, for the tools that start
    ``tools/dist_train.sh`` themselves (``tools/demo.py``,
    ``compare_comm_convergence.py``): ``PORT`` from the environment, as
    ``dist_train.sh`` reads it, so that ``PORT=29600 make demo`` keeps off
    a port another job uses. Unset (or empty), None: the tool then takes
    :func:`free_port` just before each run, so that
    two runs never meet.

    A ``PORT`` that is not an int from 1 to 65535, or that this host
    cannot listen on now (taken by another process, or privileged), is a
    usage error naming it, before any run starts. On a node other than
    the first (``NODE_RANK`` > 0) the port is the first node's, and only
    its form is checked.

    Args:
        parser (argparse.ArgumentParser): The tool's parser.
        environ (Mapping[str, str], optional): Where ``PORT`` is read.
            Defaults to ``os.environ``.

    Returns:
        str or None: The port, as ``PORT`` for ``tools/dist_train.sh``;
        None when ``PORT`` is unset.
    """
    environ = os.environ if environ is None else environ
    value = environ.get('PORT', '')
    if not value:
        return None
    port = int(value) if re.fullmatch(r'[0-9]{1,5}', value) else 0
    if not 1 <= port <= 65535:
        parser.error(f'PORT={value!r} is not a TCP port: give an int from 1 '
                     'to 65535, or leave PORT unset for a free port')
    if environ.get('NODE_RANK', '0') in ('', '0'):
        error = _bind_error(port)
        if error is not None:
            why = ('another process listens there'
                   if error.errno == errno.EADDRINUSE else error.strerror)
            parser.error(f'PORT={port} cannot be used on this host ({why}): '
                         'set PORT to a free port, or leave it unset for a '
                         'free one')
    return str(port)
