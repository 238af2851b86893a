"""Keep the pytest process free of OpenMP thread pools.

tests/dist_utils.py forks the pytest process to start gloo ranks. A process
that forks after its OpenMP runtime started a thread team (any multi-threaded
torch op, e.g. building a large model in a test) leaves the children hanging
in their first parallel region. One thread in the parent means no team is
ever started; each forked rank then runs single-threaded, which is also what
two ranks on a 2-core machine want.
"""
import torch

torch.set_num_threads(1)
