"""One training run per work dir, held with a lock file.

Two trainings started on one work dir both run to the end: they write the
same checkpoint names, the same ``last_checkpoint`` and the same log
folder, and whatever is on disk afterwards is a mix of the two, with
neither run told. ``tools/train.py`` therefore takes
``<work_dir>/train.lock`` before it looks at the work dir's checkpoints
(on global rank 0, which writes them) and holds it until the run ends. A
second training on the same work dir is refused, naming the holder: its
pid, host, start time and command, which the holder writes into the file.

* **The lock is the kernel's** (``fcntl.lockf``, a POSIX record lock on the
  open file), not the file's existence: a holder that is SIGKILLed or whose
  machine goes down releases it without running any code, so a stale file
  never blocks the next run. The holder's details left in such a file are
  said once, as a warning, when the next run takes the lock over.
* **Released by unlinking while held.** At the end the holder removes the
  file, then closes it. A run that opened the old file just before could
  lock a file that no longer has a name; after locking, the file's inode is
  compared with the name's, and a mismatch is retried, so two runs never
  hold two different files of the same name.
* **Network file systems.** On NFSv4 the server keeps the lock (a lease):
  runs on different hosts refuse each other, and the lock of a host that
  died without releasing it is freed when its lease ends (about 90 s by
  default), until then the next run is refused and names it. NFSv3 needs
  the lock manager (``lockd``); Lustre needs ``-o flock`` for locks that
  hold across nodes (``-o localflock`` locks only within one node: a run on
  another node is not refused). Where the file system refuses locks
  (``ENOLCK``, ``EOPNOTSUPP``: NFS mounted ``nolock``, Lustre without
  flock), the run goes on unlocked and says once that two runs on this work
  dir would not be refused.
* **Never through a link.** The holder writes its details into the file,
  so a ``train.lock`` that is a symbolic or hard link (a work dir copied
  with ``cp -rs``, a sync tool's link farm) would have the run overwrite
  the file it points to. It is opened with ``O_NOFOLLOW`` and checked to
  be a plain file with one name
  (:func:`~mmcv_custom.integrity.open_own_file`); otherwise the start is
  refused, naming the link and its target, and nothing is written.

Standard library only.
"""
import errno
import json
import os
import os.path as osp
import socket
import sys
import time
from typing import Optional

from ..integrity import LinkedFileError, open_own_file, process_alive

__all__ = ['LOCK_FILE', 'WorkDirBusy', 'WorkDirLock']

#: The lock file, inside the work dir.
LOCK_FILE = 'train.lock'
# The errors of a file system that takes no locks.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# The errors of a lock held by another process.
_HELD = (errno.EACCES, errno.EAGAIN)


class WorkDirBusy(RuntimeError):
    """Another process holds the work dir's lock; ``str()`` names it."""

    def __init__(self, message: str, holder: dict) -> None:
        super().__init__(message)
        self.holder = holder


def _describe(holder: dict) -> str:
    """The holder as a message names it: pid, host, start, command."""
    if not holder:
        return 'a process that left no details'
    parts = [f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"]
    if holder.get('started'):
        parts.append(f"started {holder['started']}")
    if holder.get('command'):
        parts.append(f"running {holder['command']}")
    return ', '.join(parts)


class WorkDirLock:
    """The lock of one work dir (see the module's description).

    Args:
        work_dir (str): The run's work dir; made when missing (and removed
            again on release, with the folders made for it, while they
            stay empty).

    Attributes:
        path (str): The lock file.
        previous (dict): The details a holder that never released it left
            in the file (it was killed, or its machine went down); empty
            when the file was absent or released. Set by :meth:`acquire`.
        unsupported (str, optional): Why the file system refused to lock,
            when it did (the run then goes on unlocked).
    """

    def __init__(self, work_dir: str) -> None:
        self.work_dir = work_dir
        self.path = osp.join(work_dir, LOCK_FILE)
        self.previous: dict = {}
        self.unsupported: Optional[str] = None
        self._fd: Optional[int] = None
        self._made: list = []

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> 'WorkDirLock':
        """Take the lock, or raise :class:`WorkDirBusy` naming its holder.

        Raises:
            WorkDirBusy: Another process holds it.
            LinkedFileError: The lock file is a symbolic or hard link, or
                not a plain file (nothing was written).
            OSError: The work dir cannot be made or written (the preflight
                has said why before this is called).
        """
        if self._fd is not None:
            return self
        # The folders made here, deepest first, removed again on release
        # while they stay empty (a refused start leaves nothing behind).
        missing, folder = [], osp.abspath(self.work_dir)
        while not osp.isdir(folder):
            missing.append(folder)
            folder = osp.dirname(folder)
        os.makedirs(self.work_dir, exist_ok=True)
        self._made = missing
        import fcntl
        for _ in range(10):
            try:
                fd = open_own_file(self.path, os.O_RDWR | os.O_CREAT)
            except LinkedFileError as e:
                raise LinkedFileError(
                    f"{e}: the work dir's lock file is never written "
                    'through a link (the run writes its pid and command '
                    'into it, which would overwrite what the link points '
                    'to)') from None
            except OSError:
                self._remove_made()
                raise
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd)
                os.close(fd)
                if e.errno in _HELD:
                    raise WorkDirBusy(
                        f'work_dir {self.work_dir!r} is in use by another '
                        f'training ({_describe(holder)}): it holds '
                        f'{self.path}', holder) from None
                if e.errno in _NO_LOCKS:
                    self.unsupported = (
                        f'the file system of {self.work_dir!r} takes no '
                        f'locks ({e.strerror}): a second training on this '
                        'work dir would not be refused')
                    return self
                raise
            if not _same_file(fd, self.path):
                # Released (unlinked) by its holder after we opened it.
                os.close(fd)
                continue
            self.previous = _read(fd)
            _write(fd, self._details())
            self._fd = fd
            return self
        raise WorkDirBusy(
            f'work_dir {self.work_dir!r}: could not take {self.path}: '
            'other runs keep taking and releasing it', {})

    def stale_note(self) -> Optional[str]:
        """One line about the holder that never released the lock, when
        there was one; None otherwise."""
        if not self.previous:
            return None
        gone = ''
        pid, host = self.previous.get('pid'), self.previous.get('host')
        if host == socket.gethostname() and isinstance(pid, int):
            gone = (' (that process is gone)'
                    if not process_alive(pid) else '')
        return (f'took over the lock of work_dir {self.work_dir!r} from '
                f'{_describe(self.previous)}{gone}, which ended without '
                'releasing it: it was killed, or its machine went down')

    def release(self) -> None:
        """Give the lock up: the file goes, then the lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)
        self._remove_made()

    def _remove_made(self) -> None:
        """Remove the folders :meth:`acquire` made, while still empty."""
        made, self._made = self._made, []
        for folder in made:
            try:
                os.rmdir(folder)  # only if still empty
            except OSError:
                break

    def __enter__(self) -> 'WorkDirLock':
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()

    @staticmethod
    def _details() -> dict:
        return dict(
            pid=os.getpid(),
            host=socket.gethostname(),
            started=time.strftime('%Y-%m-%d %H:%M:%S %Z'),
            command=' '.join([osp.basename(sys.executable)] + sys.argv))


def _same_file(fd: int, path: str) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _read(fd: int) -> dict:
    """The details in the lock file; {} when empty or unreadable."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 65536)
        found = json.loads(raw.decode()) if raw.strip() else {}
    except (OSError, ValueError):
        return {}  # a holder killed while writing them
    return found if isinstance(found, dict) else {}


def _write(fd: int, details: dict) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(details).encode() + b'\n')
