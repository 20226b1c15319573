"""Dropout's (seed, offset) for one call (mods/philox.py: the key is the seed, the counter's last word the
offset's low 32 bits), drawn on the host as the launch arguments the forward passes and autograd saves for the
backward, which redraws the same keep mask from them.

  torch tensors   the CUDA default generator of q's device, as torch's own fused attention reads its Philox
                  state: seed = the generator's seed, offset = its Philox offset, which the call then advances
                  by OFFSET_STEP (torch's offsets move in multiples of 4), so torch.manual_seed reproduces the
                  masks and every call after it draws a fresh one. The generator's offset is read, not a uint64
                  drawn from it: drawing would be a device op and a sync.
  CuPy arrays     `dropout_seed=` (an int: the same mask every call with it), else a counter tiledsl holds:
                  seed HELD_SEED, offsets advancing by OFFSET_STEP per call from 0 (so a process's masks repeat
                  from run to run, as torch's default seed makes them).

Under CUDA-graph capture the pair would be baked into the graph, and every replay would draw the same mask:
dropout is refused there (capture with dropout_p=0)."""
from __future__ import annotations

import itertools
import numbers
import threading

from ..errors import RuntimeInputError
from ..runtime.device import capturing
from ..runtime.tensors import is_torch

OFFSET_STEP = 4        # offsets one call owns: torch requires multiples of 4, and the kernels read one
HELD_SEED = 0x5EED     # the held counter's seed (CuPy calls without dropout_seed)
_held = itertools.count(0, OFFSET_STEP)
_held_lock = threading.Lock()


def dropout_probability(where: str, dropout_p) -> float | None:
    """`dropout_p` checked (a number in [0, 1)); None for 0, which runs the plain kernels."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise RuntimeInputError(f"{where}: dropout_p is the probability of dropping a weight, a number in [0, 1); "
                                f"got {dropout_p!r}")
    return float(dropout_p) or None


def refuse_dropout(where: str, dropout_p) -> None:
    """The serving entry points (decode, paged, varlen) have no dropout kernel: any dropout_p but 0 is refused."""
    if dropout_p is not None and dropout_p != 0:
        raise RuntimeInputError(f"{where}: dropout is a training-time modification; the {where} kernels have none "
                                f"(got dropout_p={dropout_p!r}): tiledsl.attention takes dropout_p on batched "
                                "sequences")


def draw_rng(where: str, like, dropout_seed=None) -> tuple[int, int]:
    """(seed, offset) of one dropout call on `like`'s framework and device (the module docstring)."""
    if capturing(like):
        raise RuntimeInputError(f"{where}: dropout under CUDA-graph capture would replay one keep mask on every "
                                "replay (its seed and offset are launch arguments); run dropout outside the graph, "
                                "or capture with dropout_p=0")
    if dropout_seed is not None:
        if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, numbers.Integral) \
                or not 0 <= int(dropout_seed) < 1 << 64:
            raise RuntimeInputError(f"{where}: dropout_seed is an int in 0..2^64-1, got {dropout_seed!r}")
        return int(dropout_seed), 0
    if is_torch(like):
        import torch
        index = like.device.index if like.device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        offset = int(generator.get_offset())
        generator.set_offset(offset + OFFSET_STEP)
        return int(generator.initial_seed()) & ((1 << 64) - 1), offset
    with _held_lock:
        return HELD_SEED, next(_held)
