"""Page-locking a host mapping for CUDA (``cudaHostRegister``) and undoing it.

A registered range is pinned: the GPU's copy engines read and write it by DMA (a
``non_blocking`` copy really is asynchronous), and, on a system with unified virtual
addressing, kernels can read it in place over PCIe. The role of SGLang's
``_cuda_host_register`` (``mem_cache/pool_host/common.py``), without chunking: one range, one
call. Every failure is returned as a reason, never raised, so the DRAM tier can stay pageable.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: pinned, and mapped where UVA is on
# cudaDevAttrCanUseHostPointerForRegisteredMem (driver_types.h): kernels may dereference the host
# address of registered memory as it is.
ATTR_CAN_USE_HOST_POINTER = 91


def _cudart():
    """torch's CUDA runtime bindings, or the reason there are none."""
    try:
        import torch  # noqa: PLC0415 - only where CUDA is asked for

        if not torch.cuda.is_available():
            return None, "no CUDA device"
        return torch.cuda.cudart(), None
    except Exception as exc:  # a CPU-only torch, a broken driver
        return None, f"{type(exc).__name__}: {exc}"


def libcudart_path(maps_text: str) -> str | None:
    """Path of the CUDA runtime library mapped in a process, from its ``/proc/<pid>/maps`` text."""
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libcudart.so"):
            return fields[5].strip()
    return None


def _libcudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (found in ``/proc/self/maps``), or None."""
    path = libcudart_path(Path("/proc/self/maps").read_text())
    return None if path is None else ctypes.CDLL(path)


def host_pointer_usable_on_device(device_index: int) -> bool | None:
    """Whether kernels on ``device_index`` can read registered host memory at its host address.

    Reads ``cudaDevAttrCanUseHostPointerForRegisteredMem`` through the runtime library torch
    loaded.

    Returns:
        True or False as the driver says; None when it could not be asked (logged at INFO).
    """
    try:
        lib = _libcudart()
        if lib is None:
            logger.info("libcudart not found in /proc/self/maps; cannot ask about host pointers")
            return None
        value = ctypes.c_int(0)
        rc = lib.cudaDeviceGetAttribute(ctypes.byref(value), ATTR_CAN_USE_HOST_POINTER, int(device_index))
        if rc != 0:
            lib.cudaGetLastError()
            logger.info("cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem) failed: rc=%d", rc)
            return None
        return bool(value.value)
    except Exception as exc:
        logger.info("cannot ask the CUDA runtime about host pointers: %s", exc)
        return None


def clear_last_cuda_error() -> bool:
    """Reset the CUDA runtime's per-thread last error after a failed runtime call.

    A failed ``cudaHostRegister`` leaves its error as the thread's "last error", which torch's
    next kernel-launch check (``cudaGetLastError``) would raise as if the kernel had failed.
    torch's bindings do not expose ``cudaGetLastError``, so it is called through the runtime
    library already mapped in this process (the same instance torch uses).

    Returns:
        True when the error was cleared; False when the library was not found (logged).
    """
    try:
        lib = _libcudart()
        if lib is None:
            logger.info("libcudart not found in /proc/self/maps; the CUDA last error is left as it is")
            return False
        lib.cudaGetLastError()
        return True
    except Exception as exc:
        logger.info("could not clear the CUDA last error: %s", exc)
        return False


def cuda_host_register(ptr: int, nbytes: int) -> str | None:
    """Pin ``nbytes`` bytes of host memory at address ``ptr`` (``cudaHostRegister``, default flags).

    Returns:
        None when the range is registered; else why not (no CUDA, the driver's error string).
    """
    if nbytes <= 0 or ptr == 0:
        return f"nothing to register (ptr {ptr:#x}, {nbytes} bytes)"
    cudart, reason = _cudart()
    if cudart is None:
        return reason
    try:
        rc = int(cudart.cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_DEFAULT))
    except Exception as exc:
        return f"cudaHostRegister raised {type(exc).__name__}: {exc}"
    if rc == 0:
        return None
    clear_last_cuda_error()
    return f"cudaHostRegister({nbytes} bytes) failed: rc={rc} ({_error_string(cudart, rc)})"


def cuda_host_unregister(ptr: int) -> str | None:
    """Unpin a range registered by :func:`cuda_host_register` at ``ptr``.

    Waits for the device first (``torch.cuda.synchronize``), so no copy still in flight reads
    or writes the range when it stops being pinned.

    Returns:
        None on success; else why it failed (the range then stays pinned until the process exits).
    """
    cudart, reason = _cudart()
    if cudart is None:
        return reason
    try:
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()
        rc = int(cudart.cudaHostUnregister(ptr))
    except Exception as exc:
        return f"cudaHostUnregister raised {type(exc).__name__}: {exc}"
    if rc == 0:
        return None
    clear_last_cuda_error()
    return f"cudaHostUnregister failed: rc={rc} ({_error_string(cudart, rc)})"


def _error_string(cudart, rc: int) -> str:
    try:
        return str(cudart.cudaGetErrorString(rc))
    except Exception:
        return "?"
