"""Choosing the attention implementation: Triton on CUDA, torch on the CPU, or forced by name.

Both backends have the same three operations and the same arguments; the model
never knows which one runs. ``select_backend("auto", device)`` picks Triton on
CUDA and torch elsewhere; ``"triton"`` on a CPU device is allowed only under
the Triton interpreter (``TRITON_INTERPRET=1``), which the kernel tests use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from engine.kernels import reference

BackendName = Literal["auto", "triton", "torch"]


@dataclass(frozen=True)
class AttentionBackend:
    """The three paged-attention operations of one implementation (see :mod:`engine.kernels.reference`)."""

    name: str
    write_kv: Callable[..., None]
    paged_decode: Callable[..., torch.Tensor]
    paged_prefill: Callable[..., torch.Tensor]


def _torch_backend() -> AttentionBackend:
    return AttentionBackend("torch", reference.write_kv, reference.paged_decode, reference.paged_prefill)


def _triton_backend() -> AttentionBackend:
    # Imported here so that importing the engine never initialises Triton.
    from engine.kernels import triton_kernels

    return AttentionBackend("triton", triton_kernels.write_kv, triton_kernels.paged_decode,
                            triton_kernels.paged_prefill)


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch_backend, "triton": _triton_backend}


def triton_interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set (Triton then runs kernels on the CPU in numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called ``name`` (``auto``, ``triton`` or ``torch``) for tensors on ``device``.

    Raises ``ValueError`` for an unknown name, or for ``triton`` on a non-CUDA
    device without the interpreter.
    """
    if name not in get_args(BackendName):
        raise ValueError(f"unknown attention backend {name!r}; choose one of {list(get_args(BackendName))}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError(f"attention backend 'triton' needs a CUDA device (got {device.type!r}) "
                         "or TRITON_INTERPRET=1 to run the kernels on the CPU")
    return _BACKENDS[name]()
