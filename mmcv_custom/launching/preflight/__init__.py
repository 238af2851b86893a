"""Check what a run needs before anything heavy starts, and say it all once.

MMEngine finds a missing dataset, pretrained file or checkpoint only when it
reaches it: after the process group started and the whole model was built
(billions of parameters for InternViT-6B), one problem per attempt, in the
words of whatever failed (``[Errno 2] ... images/training``). The tools call
:func:`check_preflight` right after the config is merged and the checkpoint
to load is chosen, and report every problem found, each with what to do
about it, before any of that:

* the data of every dataset the run reads (``data_root`` with each
  ``data_prefix`` folder, ``ann_file``), through dataset wrappers
  (``dataset``, ``datasets``); a dataset class that writes its own data
  (``generates_data(cfg)``, as
  :class:`~mmcv_custom.datasets.ToyShapesDataset`) is left out;
* ``load_from``, the checkpoint ``--resume`` takes and ``tools/test.py``'s
  CHECKPOINT: there, intact and holding only what the safe loader allows
  (:func:`mmcv_custom.integrity.checkpoint_choice.check_checkpoint_file`);
  URLs are left to MMEngine;
* (training) every pretrained file of the model: ``pretrained`` keys and
  ``init_cfg=dict(type='Pretrained', checkpoint=...)`` anywhere in it;
* ``strategy`` (FSDP2Strategy): its keys and values, and whether its
  ``sharding`` holds on the nodes the launcher started (hybrid on one
  node, ``ranks_per_node`` that does not divide the world or contradicts
  the launcher), which the strategy would find only once every rank has
  joined the process group;
* ``comm_hook``: its names and values (:func:`check_comm_hook_cfg`, and
  under FSDP2 whether the type has a sharded form), which the runner hook
  would check only once the model is built;
* ``custom_hooks``: a list of hook configs whose types are registered
  (the runner builds them only after the model; a dict written through
  ``--cfg-options`` stays a string);
* the launcher's environment: ``--launcher pytorch``, ``slurm`` or ``mpi``
  in a process that torchrun, ``srun`` or ``mpirun`` did not start;
* the work dir, and the CheckpointHook's ``out_dir`` when it has one:
  writable (nothing is left behind), and, for training, room on the
  checkpoints' disk for one save (:func:`checkpoint_size`: the weights,
  the optimizer state and every rank's hook state file), estimated from
  the model built on the meta device (no memory; a second for
  InternViT-6B). When the estimate fails, the room is not checked;
* problems the caller found first (``first``: where ``tools/train.py``'s
  run would start, see :mod:`mmcv_custom.launching.run_start`).

:func:`checked_config` reads the config itself, so that a missing or
unreadable config file is reported the same way.

Only configs and file systems are read; no model memory is allocated.

Modules, one concern each: :mod:`.problems` (what is said),
:mod:`.core` (the checks in order, the config read), :mod:`.report` (who
says it, and the exit), and one per check: :mod:`.launcher_env`,
:mod:`.config_values`, :mod:`.strategy`, :mod:`.data`, :mod:`.weights`,
:mod:`.work_dir` with :mod:`.checkpoint_size`.
"""
from .checkpoint_size import (CheckpointSize, checkpoint_size,
                              estimate_checkpoint_bytes, format_size)
from .core import check_preflight, checked_config, preflight
from .problems import PreflightError, Problem, format_problems
from .report import exit_on_problems, preflight_report

__all__ = [
    'Problem', 'PreflightError', 'preflight', 'check_preflight',
    'checked_config', 'format_problems', 'estimate_checkpoint_bytes',
    'checkpoint_size', 'CheckpointSize', 'format_size', 'preflight_report',
    'exit_on_problems'
]
