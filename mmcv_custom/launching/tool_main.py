"""What ``tools/train.py`` and ``tools/test.py`` share around their own work.

Both are started the same ways (by hand, ``dist_*.sh`` through torchrun,
``slurm_*.sh`` through srun, ``torch.distributed.launch``), so they take the
same launch arguments, start the same way (a rank ends with its launcher,
the console, the config checked before anything else) and end the same
way on a failure (the cause once, from the first rank that failed). What
they do in between, and the run itself (:mod:`.running`), is theirs.
"""
import argparse
import contextlib
import os
import sys
from typing import Callable

from mmengine.config import Config
from mmengine.logging import print_log

from ..engine.process_group import is_launch_rank0
from ..integrity import CheckpointDamagedError
from ..integrity.checkpoint import is_sharded_checkpoint
from ..integrity.sharded_checkpoint import consolidated_file
from .cfg_options import CfgOptionsAction
from .console import ToolConsole, report_failure
from .cpu_start import uses_fsdp2
from .lifetime import die_with_launcher
from .preflight import PreflightError, checked_config, exit_on_problems

__all__ = [
    'add_launch_arguments', 'parse_tool_args', 'start_tool',
    'load_consolidated', 'run_tool'
]


def add_launch_arguments(parser: argparse.ArgumentParser,
                         cfg_options_help: str) -> None:
    """``--cfg-options`` (described by the tool) and ``--launcher``, as
    MMSegmentation's tools take them."""
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=CfgOptionsAction,
        help=cfg_options_help)
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')


def parse_tool_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``--verbose`` and ``--local_rank`` added last, the command line
    parsed; ``LOCAL_RANK`` set from ``--local_rank`` where no launcher set
    it."""
    parser.add_argument(
        '--verbose',
        action='store_true',
        help='print the environment, the full config, the hook table and '
        'third-party warnings on the console too (the log file always has '
        'them)')
    # torch.distributed.launch passed --local_rank; torchrun sets LOCAL_RANK.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args()
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def start_tool(tool: str, args: argparse.Namespace) -> Config:
    """The start of ``tool``: this rank tied to its launcher (SIGKILL
    included), the console taken over (a header, the progress and a
    summary; the rest in the log file), and the config read and checked.
    A config that cannot be read stops every rank, one per node saying
    why (exit 2, as for usage)."""
    die_with_launcher(args.launcher)
    console = ToolConsole(tool, verbose=args.verbose).start()
    console.work_dir = args.work_dir
    try:
        cfg = checked_config(args.config, args.cfg_options, args.work_dir)
    except PreflightError as e:
        exit_on_problems(e, tool, args.launcher)
    console.work_dir = cfg.work_dir
    return cfg


def load_consolidated(stack: contextlib.ExitStack, cfg: Config, checkpoint,
                      doing: str) -> None:
    """An ordinary (DDP) config given a sharded checkpoint directory of
    FSDP2Strategy reads its consolidated weights: a file made for the run,
    in ``stack``'s lifetime, becomes ``cfg.load_from`` (rank 0 logs
    ``doing`` them). An FSDP2 config reads the directory itself."""
    if not (checkpoint and is_sharded_checkpoint(checkpoint)
            and not uses_fsdp2(cfg)):
        return
    cfg.load_from = stack.enter_context(consolidated_file(checkpoint))
    if is_launch_rank0():
        print_log(
            f'{checkpoint} is a sharded checkpoint: {doing} '
            'its consolidated weights.',
            logger='current')


def run_tool(main: Callable[[], None], tool: str) -> None:
    """``main()``, and on a failure the exit: a damaged checkpoint in one
    line that names it and the newest intact one; anything else as its
    cause once, from the first rank that failed, with the traceback in
    the log file."""
    try:
        main()
    except CheckpointDamagedError as e:
        sys.exit(report_failure(e, tool, plain=True))
    except (Exception, KeyboardInterrupt) as e:
        sys.exit(report_failure(e, tool))
