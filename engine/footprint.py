"""What an object graph costs in array memory: the bytes of the distinct NumPy and CuPy
buffers reachable from some roots (a recorded tape, an operator), each buffer counted
once however many views or references reach it. Used to keep recordings within a
memory budget (the service's tape registry evicts by it)."""

from __future__ import annotations

import gc
import types
from typing import Any

import numpy as np

from engine import trace
from engine.registry import Primitive

# Never walked into: values that hold no arrays of their own, and what every recording
# shares (types, modules, primitives).
_ATOMS = (
    type,
    types.ModuleType,
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
    Primitive,
)


def held_bytes(*roots: Any, shared: tuple[type, ...] = ()) -> int:
    """Bytes of the distinct array buffers reachable from `roots`: through objects,
    containers and closures (not through module globals, types or compiled programs,
    which every tape shares; `shared` names more such types, e.g. a compiled program).
    A long walk stops at trace.check_interrupt when its computation is cancelled."""
    seen: set[int] = set()
    buffers: dict[int, int] = {}
    stack = list(roots)
    while stack:
        if len(seen) % 4096 == 0:
            trace.check_interrupt()  # a walk over a large recording stops when cancelled
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (*_ATOMS, *shared)):
            continue
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            buffers[id(base)] = base.nbytes
            continue
        memory = _device_memory(obj)
        if memory is not None:
            buffers[memory[0]] = memory[1]
            continue
        if isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            stack.extend(obj.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(obj))
    return sum(buffers.values())


def _device_memory(obj: Any) -> tuple[int, int] | None:
    """(pointer, size) of a CuPy array's allocation; None for anything else."""
    if type(obj).__module__.split(".", 1)[0] != "cupy" or not hasattr(obj, "data"):
        return None
    mem = getattr(obj.data, "mem", None)
    if mem is None:
        return None
    return int(mem.ptr), int(mem.size)
