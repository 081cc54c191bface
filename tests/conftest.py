"""Test-session settings."""

import torch

# Tests fork worker processes (Lightning's "fork" launcher, tests/distributed.py). A process that has
# already run a parallel OpenMP region cannot fork safely: the child's thread pool is gone and its
# first parallel matmul can block forever. One intra-op thread in the parent avoids that; the tests
# are small, so nothing is lost.
torch.set_num_threads(1)
