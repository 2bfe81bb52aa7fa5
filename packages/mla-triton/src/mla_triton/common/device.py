"""What the dispatch reads of the platform: the device, Triton's interpreter, the Triton release.

Every implementation choice reads the platform through these functions, so that a call's
dispatch is a pure function of them and of the call's shapes and recipe.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton

try:  # Gluon (Triton's tile language for Hopper) is experimental: present in recent releases
    from triton.experimental.gluon import language as _gl  # noqa: F401
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

    _GLUON_IMPORT_ERROR: str | None = None
except ImportError as _exc:  # pragma: no cover - depends on the installed Triton
    _GLUON_IMPORT_ERROR = str(_exc)

__all__ = [
    "GLUON_TRITON",
    "capability",
    "cuda_index",
    "gluon_api_missing",
    "hw_fp8",
    "interpreted_bf16",
    "interpreting",
    "multiprocessors",
    "triton_release",
]

GLUON_TRITON = (3, 8)
"""The Triton release whose Gluon API the Gluon kernels are written and compile-tested
against. Gluon's API moves between releases: on any other release the Triton kernels
run (one warning says so)."""

log = logging.getLogger("mla_triton")


def interpreting() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET``): kernels run on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreted_bf16(dtype: torch.dtype) -> bool:
    """Whether a bfloat16 call runs under Triton's interpreter, which computes bf16 wrongly.

    Such calls run their kernels on float32 copies of the 16-bit inputs (exact) and round
    the output to bfloat16 once: correct, slower, for tests on a CPU.
    """
    return dtype == torch.bfloat16 and interpreting()


def capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None off CUDA or under the interpreter."""
    if device.type != "cuda" or interpreting():
        return None
    return _cuda_properties(cuda_index(device))[0]


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (``cuda`` alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def multiprocessors(device: torch.device) -> int:
    """The SM count of a CUDA ``device``."""
    return _cuda_properties(cuda_index(device))[1]


@functools.lru_cache(maxsize=64)
def _cuda_properties(index: int) -> tuple[tuple[int, int], int]:
    """``(capability, SM count)`` of CUDA device ``index``: fixed for the process, read once
    (every call of the ops reads them)."""
    props = torch.cuda.get_device_properties(index)
    return (int(props.major), int(props.minor)), int(props.multi_processor_count)


def hw_fp8(device: torch.device) -> bool:
    """The device converts to and from E4M3 in hardware (sm89 and newer)."""
    cap = capability(device)
    return cap is not None and cap >= (8, 9)


def triton_release() -> tuple[int, int]:
    """The installed Triton's (major, minor) release."""
    major, minor = triton.__version__.split(".")[:2]
    return (int(major), int(minor))


@functools.cache
def gluon_api_missing() -> str | None:
    """None where the Gluon kernels can run on this Triton, else why not (checked once).

    The first time it is not None, one warning names the Triton version and the path
    taken instead (the Triton kernels, slower on Hopper).
    """
    why: str | None = None
    if triton_release() != GLUON_TRITON:
        why = (
            f"Triton {triton.__version__}: the Gluon kernels are compiled and tested for Triton "
            f"{GLUON_TRITON[0]}.{GLUON_TRITON[1]}"
        )
    elif _GLUON_IMPORT_ERROR is not None:
        why = f"the Gluon API of Triton {triton.__version__} is not usable: {_GLUON_IMPORT_ERROR}"
    if why is not None:
        log.warning("mla_triton: %s; Hopper GPUs run the Triton kernels (slower)", why)
    return why
