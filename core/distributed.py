"""Tensor-parallel layout: which rank this process is and how many ranks share the model.

Without an initialised process group the layout is one rank, and every layer holds the whole model.
"""

from __future__ import annotations

import torch.distributed as dist


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x):
    if tp_size() > 1:
        dist.all_reduce(x)
    return x
