"""Read the sharded checkpoints of :class:`~mmcv_custom.engine.FSDP2Strategy`.

A sharded checkpoint is a directory (``iter_N.pth/``) of
``torch.distributed.checkpoint`` (DCP) files, one per saving rank, plus
``meta.pth`` with MMEngine's meta, message hub and scheduler states. DCP
reshards on load, so any number of ranks (or one process) can read it.

Integrity: the saving ranks hash what they wrote, and rank 0 writes the
digests into ``SHA256SUMS`` inside the directory (``sha256sum``'s format,
one line per file, names relative to the directory: ``cd iter_8.pth &&
sha256sum -c SHA256SUMS`` checks it by hand). Every reader checks it first
(:func:`require_intact_sharded`): a shard that is missing, truncated or
has flipped bytes is named in one line, with the newest intact checkpoint
beside it, instead of DCP's traceback or, worse, wrong weights. A directory
written before manifests existed still loads (INFO once); its missing or
truncated shards are still found, from the sizes DCP's ``.metadata``
records.

Safety: DCP's default planner unpickles every non-tensor entry (the
optimizer's hyper-parameters) with ``torch.load(weights_only=False)``, which
runs whatever a crafted file says. :func:`safe_load_planner` reads them with
torch's safe loader and this project's allow-list instead
(:mod:`mmcv_custom.integrity.checkpoint`), and ``meta.pth`` is read the
same way.
"""
import contextlib
import os.path as osp
import pickle
import re
import shutil
import tempfile
import warnings
from typing import Dict, Iterable, Optional, Tuple

import torch

from .checkpoint import (DCP_METADATA_FILE, SHARDED_META_FILE,
                         UnsafeCheckpointError, is_sharded_checkpoint,
                         load_checkpoint_file, say_unverified_once)
from .files import (MANIFEST_FILE, CheckpointDamagedError, Verification,
                    atomic_write_stream, atomic_write_text,
                    checkpoint_candidates, file_sha256, unverified_refusal,
                    verify_file)

__all__ = [
    'safe_load_planner', 'safe_dcp_load', 'consolidate_sharded_checkpoint',
    'consolidated_file', 'MANIFEST_FILE', 'write_manifest', 'read_manifest',
    'verify_sharded_checkpoint', 'newest_intact_checkpoint', 'damaged_message',
    'require_intact_sharded'
]

_MANIFEST_LINE = re.compile(r'^([0-9a-f]{64}) [ *](\S.*)$')


# Directories said once to have no manifest (INFO), by absolute path.
def write_manifest(folder: str, digests: Dict[str, str]) -> None:
    """Write ``folder/SHA256SUMS``: ``digests`` (file name relative to
    ``folder`` -> SHA-256 hex digest), one line each, sorted by name."""
    text = ''.join(f'{digests[name]}  {name}\n' for name in sorted(digests))
    atomic_write_text(osp.join(folder, MANIFEST_FILE), text)


def read_manifest(folder: str) -> Optional[Dict[str, str]]:
    """The digests ``folder/SHA256SUMS`` records (name -> hex digest);
    None when the directory has no manifest.

    Raises:
        ValueError: A line is not ``<64 hex digits>  <name>``, or a name
            leaves the directory.
    """
    try:
        with open(osp.join(folder, MANIFEST_FILE), 'rb') as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    digests = {}
    for number, line in enumerate(
            raw.decode('utf-8', errors='replace').splitlines(), 1):
        if not line.strip():
            continue
        match = _MANIFEST_LINE.match(line)
        name = match.group(2) if match else ''
        if (not match or osp.isabs(name) or name == MANIFEST_FILE
                or '..' in name.split('/')):
            raise ValueError(f'line {number} is not "<SHA-256>  <file>": '
                             f'{line[:80]!r}')
        digests[name] = match.group(1)
    if not digests:
        raise ValueError('it lists no file')
    return digests


def _dcp_extents(path: str) -> Dict[str, int]:
    """File name -> the bytes it must hold at least, from DCP's
    ``.metadata`` (where each entry starts, and its length).

    Raises:
        Exception: ``.metadata`` cannot be read (whatever unpickling it
            raised).
    """
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(path).read_metadata()
    needed: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, 'relative_path', None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    return needed


def _truncated(file: str, size: int, needed: int) -> str:
    return (f'{file} is damaged: truncated to {size:,} bytes, but '
            f'{DCP_METADATA_FILE} places data up to byte {needed:,} (a full '
            'disk, or an incomplete copy)')


def _structural_damage(path: str) -> Optional[str]:
    """Without a manifest: the first shard that DCP's ``.metadata`` names
    and that is missing or shorter than the bytes it should hold; None if
    all are there (or the directory has no ``.metadata``: not a sharded
    checkpoint, said by the caller)."""
    if not osp.isfile(osp.join(path, DCP_METADATA_FILE)):
        return None
    try:
        needed = _dcp_extents(path)
    except Exception as e:  # an unpickling error of any kind
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return (
            f'{osp.join(path, DCP_METADATA_FILE)} is damaged: it cannot be '
            f'read ({first})')
    for name in sorted(needed):
        file = osp.join(path, name)
        if not osp.isfile(file):
            return (
                f'{file} is missing: {DCP_METADATA_FILE} names it (deleted, '
                'or an incomplete copy)')
        size = osp.getsize(file)
        if size < needed[name]:
            return _truncated(file, size, needed[name])
    return None


def _mismatch(path: str, name: str, actual: str, recorded: str,
              more: str) -> str:
    """The line for a file of ``path`` that differs from the manifest:
    truncated, when ``.metadata`` says it is short, else altered."""
    file = osp.join(path, name)
    if name != DCP_METADATA_FILE:
        try:
            needed = _dcp_extents(path).get(name, 0)
        except Exception:
            needed = 0  # .metadata unreadable too: hashed on its own
        size = osp.getsize(file)
        if size < needed:
            return _truncated(file, size, needed) + more
    return (f'{file} is damaged{more}: its SHA-256 is {actual[:16]}..., '
            f'but {MANIFEST_FILE} recorded {recorded[:16]}... when it was '
            'written (bytes changed since: a bad copy, a full disk or bit '
            'rot)')


def verify_sharded_checkpoint(
    path: str, part: Tuple[int, int] = (0, 1)) -> Verification:
    """Check a sharded checkpoint directory against its ``SHA256SUMS``.

    Args:
        path (str): The checkpoint directory.
        part (tuple[int, int]): ``(index, count)``: hash only the listed
            files whose position (in name order) is ``index`` modulo
            ``count``, so that ``count`` ranks share the reading; every
            listed file's presence is checked by all. Defaults to
            ``(0, 1)``: all of them.

    Returns:
        Verification: ``ok``; ``damaged`` with one line naming the first
        bad file (missing, or not its recorded SHA-256: truncated or
        flipped bytes) or the unreadable manifest; ``no_digest`` for a
        directory without a manifest (written before manifests) whose
        shards are all there at their recorded sizes, where no checkpoint
        beside it carries digests (else it is ``damaged``); ``missing`` when
        ``path`` is not a directory, or holds neither a manifest nor DCP's
        ``.metadata`` (the caller says what it expected).
    """
    if not osp.isdir(path):
        return Verification('missing', f'{path}: no such directory')
    manifest = osp.join(path, MANIFEST_FILE)
    try:
        digests = read_manifest(path)
    except ValueError as e:
        return Verification('damaged', f'{manifest} is damaged ({e})')
    if digests is None:
        if not osp.isfile(osp.join(path, DCP_METADATA_FILE)):
            return Verification(
                'missing', f'{path} holds neither {MANIFEST_FILE} nor '
                f'{DCP_METADATA_FILE}: not a sharded checkpoint')
        damage = _structural_damage(path)
        if damage is not None:
            return Verification('damaged', damage)
        refused = unverified_refusal(path)
        if refused is not None:
            return refused
        return Verification(
            'no_digest', f'{path} has no {MANIFEST_FILE} (written before '
            'sharded checkpoints had digests): loaded unverified')
    names = sorted(digests)
    for name in names:
        if not osp.isfile(osp.join(path, name)):
            return Verification(
                'damaged', f'{osp.join(path, name)} is missing: '
                f'{MANIFEST_FILE} lists it (deleted, or an incomplete copy)')
    index, count = part
    bad = []
    for name in names[index::count]:
        actual = file_sha256(osp.join(path, name))
        if actual != digests[name]:
            bad.append((name, actual))
    if bad:
        name, actual = bad[0]
        more = f' (and {len(bad) - 1} more files)' if len(bad) > 1 else ''
        return Verification('damaged',
                            _mismatch(path, name, actual, digests[name], more))
    return Verification(
        'ok', f'{path}: {len(names)} files, SHA-256 verified '
        f'({MANIFEST_FILE})')


def newest_intact_checkpoint(
    path: str, exclude: Iterable[str] = ()) -> Optional[str]:
    """The newest ``iter_N.pth``/``epoch_N.pth`` beside ``path`` (in its
    folder, not ``path`` itself nor ``exclude``) that can be loaded: a
    complete sharded directory that passes
    :func:`verify_sharded_checkpoint`, or a file that passes
    :func:`~mmcv_custom.integrity.files.verify_file`. Those older than digests
    count (as they load). Each candidate is read whole until one passes:
    only worth its time once a checkpoint was found damaged."""
    folder = osp.dirname(osp.abspath(path))
    for candidate in checkpoint_candidates(folder, exclude=[path, *exclude]):
        if osp.isdir(candidate):
            if (is_sharded_checkpoint(candidate)
                    and verify_sharded_checkpoint(candidate).usable):
                return _as_given(candidate, path)
        elif verify_file(candidate).usable:
            return _as_given(candidate, path)
    return None


def _as_given(candidate: str, path: str) -> str:
    """``candidate`` (absolute) written beside ``path`` as the user wrote
    it, so that a message names ``work_dirs/x/iter_4.pth`` next to
    ``work_dirs/x/iter_6.pth``, not an absolute path."""
    folder = osp.dirname(osp.normpath(path))  # iter_6.pth/ has a folder
    return osp.join(folder, osp.basename(candidate))


def damaged_message(result: Verification, path: str) -> str:
    """``result``'s line, with the newest intact checkpoint beside
    ``path`` named when there is one (:func:`newest_intact_checkpoint`)."""
    alternative = newest_intact_checkpoint(path)
    if alternative is None:
        return result.message + '; no intact checkpoint beside it'
    return (f'{result.message}; the newest intact checkpoint beside it is '
            f'{alternative}')


def require_intact_sharded(path: str) -> Verification:
    """:func:`verify_sharded_checkpoint` of the whole directory in this
    process, raising when it is damaged; a directory without a manifest
    is said once (INFO) and passes.

    Raises:
        CheckpointDamagedError: One line: the bad file and the newest
            intact checkpoint beside ``path`` (:func:`damaged_message`).
    """
    result = verify_sharded_checkpoint(path)
    if result.status == 'damaged':
        raise CheckpointDamagedError(damaged_message(result, path))
    if result.status == 'no_digest':
        say_unverified_once(path, result.message)
    return result


def safe_load_planner(path: str = 'the sharded checkpoint'):
    """DCP's default load planner with safe unpickling of non-tensor
    entries: one that holds anything off the allow-list raises
    :class:`.UnsafeCheckpointError` naming it."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class _SafeLoadPlanner(DefaultLoadPlanner):

        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                found = re.search(r'GLOBAL ([\w.]+)', str(e))
                what = found.group(1) if found else 'an object'
                raise UnsafeCheckpointError(
                    f'Refusing to load {path}: its entry {fqn} holds '
                    f'{what}, which is not on the allow-list of safe '
                    'checkpoint contents (tensors, containers, numbers, '
                    'strings).') from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _SafeLoadPlanner()


def safe_dcp_load(state: dict, path: str, **kwargs) -> None:
    """``torch.distributed.checkpoint.load`` of ``path`` into ``state`` with
    :func:`safe_load_planner`; an unsafe entry raises
    :class:`.UnsafeCheckpointError` on every rank,
    not DCP's wrapper around it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        dcp.load(
            state,
            checkpoint_id=path,
            planner=safe_load_planner(path),
            **kwargs)
    except CheckpointException as e:
        # failures: rank -> (exception, traceback) in torch 2.13.
        found = [
            f[0] if isinstance(f, tuple) else f for f in e.failures.values()
        ]
        unsafe = [f for f in found if isinstance(f, UnsafeCheckpointError)]
        if unsafe:
            raise unsafe[0] from None
        raise


def consolidate_sharded_checkpoint(path: str) -> dict:
    """The model of a sharded checkpoint as one ordinary checkpoint.

    Reads in this process, without a process group, whatever the number of
    ranks that saved it.

    Args:
        path (str): A sharded checkpoint directory.

    Returns:
        dict: ``{'meta': ..., 'state_dict': {name: full tensor}}``, what
        MMEngine's ``load_from`` and ``tools/test.py`` take. The optimizer
        state is left out (it only serves a resume, which reads the
        directory itself).

    Raises:
        CheckpointDamagedError: A file of ``path`` is missing or differs
            from ``SHA256SUMS`` (:func:`require_intact_sharded`).
        FileNotFoundError: ``path`` is not a complete sharded checkpoint.
    """
    return _consolidate(path)[0]


def _consolidate(path: str) -> Tuple[dict, Optional[Verification]]:
    """:func:`consolidate_sharded_checkpoint`, and what verified ``path``
    (None: not a directory, refused below)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verified = None
    if osp.isdir(path):
        # First: a manifest names a missing .metadata or meta.pth, which
        # the completeness test below would only call incomplete.
        verified = require_intact_sharded(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f'{path} is not a complete sharded checkpoint (a directory '
            f'holding .metadata and {SHARDED_META_FILE}, written by '
            'FSDP2Strategy)')
    prefix = 'model.'
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in FileSystemReader(
            path).read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        # "torch.distributed is ... uninitialized, assuming the intent is to
        # load in a single process": that is the intent.
        warnings.filterwarnings('ignore', message='torch.distributed is')
        safe_dcp_load(state, path, no_dist=True)
    meta = load_checkpoint_file(osp.join(path, SHARDED_META_FILE))
    return {
        'meta': meta.get('meta', {}),
        'state_dict': {
            k[len(prefix):]: v
            for k, v in state.items()
        },
    }, verified


@contextlib.contextmanager
def consolidated_file(path: str):
    """A temporary ordinary checkpoint file of the sharded checkpoint
    ``path`` (:func:`consolidate_sharded_checkpoint`), removed on exit: for
    a runner that only loads files (``load_from`` of a DDP config). Each
    process writes its own, so no rank waits on another's file system.

    What vouches for the weights is ``path``'s ``SHA256SUMS``, checked
    here and said once (INFO, ``SHA-256 verified (SHA256SUMS)``; a
    directory without one is said to load unverified). The file is written
    with its digest: the runner's loader checks every file it reads, and
    would otherwise call this one, which it cannot tell from a file
    without a digest, "loaded unverified"."""
    folder = tempfile.mkdtemp(prefix='sharded_ckpt_')
    try:
        file = osp.join(folder, 'model.pth')
        checkpoint, verified = _consolidate(path)
        atomic_write_stream(file, lambda f: torch.save(checkpoint, f))
        if verified is not None and verified.status == 'ok':
            from mmengine.logging import print_log
            print_log(verified.message, logger='current')
        yield file
    finally:
        shutil.rmtree(folder, ignore_errors=True)
