"""One rank of :func:`~.calibrate.calibrate`, run on each emulated node.

Run by path (``python -P calibration_rank.py --calibration-child NUMEL
WARMUP ITERS OUT``, see :mod:`.programs`), possibly by another interpreter
than the caller's (the one with torch), so it imports only the standard
library and torch, nothing of the package.
"""
import json
import os
import sys
import time
from typing import List

__all__ = ['CALIBRATION_FLAG']

#: This file run as a rank of the calibration.
CALIBRATION_FLAG = '--calibration-child'


def _calibration_child(numel: int, warmup: int, iters: int, out: str) -> None:
    """One rank of :func:`calibrate`, run on each node."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ['RANK'] = os.environ['NODE_RANK']
    os.environ['WORLD_SIZE'] = os.environ['NNODES']
    os.environ['MASTER_PORT'] = os.environ['PORT']
    dist.init_process_group(
        'gloo', init_method='env://', timeout=timedelta(minutes=10))
    try:
        tensor = torch.zeros(numel, dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            with open(out + '.tmp', 'w') as f:
                json.dump({'times': slowest.tolist()}, f)
            os.replace(out + '.tmp', out)
    finally:
        dist.destroy_process_group()


def _main(argv: List[str]) -> int:
    if len(argv) == 5 and argv[0] == CALIBRATION_FLAG:
        _calibration_child(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
        return 0
    sys.stderr.write('this module is a library; run '
                     'tools/emulated_cluster.py --calibrate\n')
    return 2


if __name__ == '__main__':
    sys.exit(_main(sys.argv[1:]))
