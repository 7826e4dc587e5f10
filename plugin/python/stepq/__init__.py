"""stepq: the compressed recurrent-state pool for Gated DeltaNet / Kimi Delta
Attention inference servers, from Python.

Pure Python over the installed libstepq (ctypes, no compiled extension). The
library is found by the STEPQ_LIBRARY environment variable (a path), then by
the system loader. Importing needs neither torch nor a GPU: the host backend
takes numpy arrays, the CUDA backend torch tensors.

    import stepq
    m = stepq.load_map("config/calibrated/tiny-gdn/stepq@6.json")
    pool = stepq.StatePool(m, size=16, device="cpu")
    stepq.plan_pool(m, size=16)["page_bytes"]   # the bytes, without allocating
    ids = pool.alloc(2)          # None when full
    pool.decode(0, q, k, v, a, b, A_log, dt_bias, cache_indices=ids, out=o)
    pool.free(ids)

Errors: StepqError(name, message) carries the library's status name
("STEPQ_EDOUBLEFREE") and detail text; arguments refused before the library
is called raise StepqArgumentError, also a ValueError.
"""

from . import _lib
from .errors import StepqArgumentError, StepqError
from .map import Map, load_map, load_map_buffer
from .pool import StatePool, plan_pool

__all__ = ["StatePool", "plan_pool", "Map", "load_map", "load_map_buffer", "StepqError",
           "StepqArgumentError", "library_version", "library_path", "SLOT_PAD", "SLOT_SENTINEL",
           "HEALTH_INPUT", "HEALTH_STATE", "HEALTH_SATURATED", "HEALTH_OUTPUT"]

__version__ = "0.1.0"

SLOT_PAD = _lib.SLOT_PAD
SLOT_SENTINEL = _lib.SLOT_SENTINEL
HEALTH_INPUT, HEALTH_STATE = _lib.HEALTH_INPUT, _lib.HEALTH_STATE
HEALTH_SATURATED, HEALTH_OUTPUT = _lib.HEALTH_SATURATED, _lib.HEALTH_OUTPUT

library_path = _lib.path


def library_version():
    """The loaded library's version string ("0.1.0")."""
    return _lib._text(_lib.lib.stepq_version_string())
