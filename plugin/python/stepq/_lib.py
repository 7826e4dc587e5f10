"""ctypes bindings of libstepq's public C API (plugin/include/stepq/*.h).

Every structure here mirrors its C struct field for field, in order; the
versioned ones (size, magic, version first) are filled from their
*_INITIALIZER values by ``new()``. tests/test_structs.py compares each one's
size, field offsets and initialised bytes with a C program built from the
headers, so a header change that is not made here fails a test.

The library is found by ``STEPQ_LIBRARY`` (a path), then by the system
loader (``libstepq.so.<major>.<minor>``, ``libstepq.so``, ``ctypes.util``).
"""

import ctypes
import ctypes.util
import os

# --- Constants (common.h, pool.h, step.h, map.h) ---------------------------

CONFIG_MAGIC = 0x53545051  # "STPQ"
VERSION_MAJOR, VERSION_MINOR = 0, 1

POOL_CONFIG_VERSION = 1
MAP_LOAD_CONFIG_VERSION = 2
STEP_ARGS_VERSION = 1
PREFILL_ARGS_VERSION = 1

SLOT_SENTINEL = 0
SLOT_PAD = -1

BACKEND_HOST, BACKEND_CUDA = 0, 1
POLICIES = {"no_cache": 0, "no_buffer": 1, "lazy": 2, "extra_buffer": 3}
POOL_FLAG_CLEAR_ON_ALLOC = 1 << 0
POOL_CLOSE_FORCE = 1 << 0

STEP_L2NORM = 1 << 0
STEP_GATE_IN_KERNEL = 1 << 1
STEP_BETA_SIGMOID = 1 << 2

LAYOUT_KV, LAYOUT_VK = 0, 1
OP_DECODE_STEP, OP_PREFILL_PACK, OP_PREFILL_UNPACK = 0, 1, 2

ARCHS = {0: "gdn", 1: "kda"}
DTYPES = {"fp32": 0, "bf16": 1, "fp16": 2}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CONV_MAX_RANK = 4
BITS_PIVOT = 16
BITS_DENSE = 0

HEALTH_INPUT, HEALTH_STATE, HEALTH_SATURATED, HEALTH_OUTPUT = 0x1, 0x2, 0x4, 0x8

# The status list (common.h, STEPQ_STATUS_MAP); a test checks each value's
# name against stepq_status_name().
STATUS = {
    "STEPQ_OK": 0,
    "STEPQ_EINVAL": -22,
    "STEPQ_ENOMEM": -12,
    "STEPQ_ENOENT": -2,
    "STEPQ_EIO": -5,
    "STEPQ_EBUSY": -16,
    "STEPQ_ENOSPC": -28,
    "STEPQ_ERANGE": -34,
    "STEPQ_EEXIST": -17,
    "STEPQ_EBADF": -9,
    "STEPQ_ENOTSUP": -95,
    "STEPQ_EVERSION": -1001,
    "STEPQ_EPARSE": -1002,
    "STEPQ_ESCHEMA": -1003,
    "STEPQ_ESHAPE": -1004,
    "STEPQ_ENONFINITE": -1005,
    "STEPQ_EDOUBLEFREE": -1006,
    "STEPQ_ECUDA": -1007,
    "STEPQ_ENCCL": -1008,
    "STEPQ_ENODEV": -19,
    "STEPQ_ETIMEDOUT": -110,
    "STEPQ_EINTERNAL": -1009,
}
EINVAL = STATUS["STEPQ_EINVAL"]
ESHAPE = STATUS["STEPQ_ESHAPE"]
ENOSPC = STATUS["STEPQ_ENOSPC"]
ENOENT = STATUS["STEPQ_ENOENT"]

# --- Structures -------------------------------------------------------------

c_size_t, c_uint, c_int = ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
c_int32, c_int64, c_uint32, c_uint64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64
c_void_p, c_double, c_float, c_char_p = ctypes.c_void_p, ctypes.c_double, ctypes.c_float, ctypes.c_char_p
c_enum = ctypes.c_int  # every stepq enum fits an int (C11 6.7.2.2)


class _Versioned(ctypes.Structure):
    """A config struct of the NCCL pattern: size, magic, version first."""

    _version = 0
    _defaults = {}

    @classmethod
    def new(cls, **fields):
        """An instance set as the C *_INITIALIZER sets it, then ``fields``."""
        s = cls()  # ctypes zero-fills: every INITIALIZER field not listed is 0 / NULL
        s.size = ctypes.sizeof(cls)
        s.magic = CONFIG_MAGIC
        s.version = cls._version
        for name, value in {**cls._defaults, **fields}.items():
            setattr(s, name, value)
        return s


class MapLoadConfig(_Versioned):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("max_bytes", c_size_t),
        ("max_values", c_size_t),
    ]
    _version = MAP_LOAD_CONFIG_VERSION


class ModelShape(ctypes.Structure):
    _fields_ = [
        ("arch", c_enum),
        ("n_layers", c_int),
        ("layer_ids", ctypes.POINTER(c_int)),
        ("num_k_heads", c_int),
        ("num_v_heads", c_int),
        ("head_k_dim", c_int),
        ("head_v_dim", c_int),
        ("conv_rank", c_int),
        ("conv_shape", c_int64 * CONV_MAX_RANK),
        ("conv_dtype", c_enum),
    ]


class UnitStats(ctypes.Structure):
    _fields_ = [
        ("log_retention", c_double),
        ("lambda_", c_double),  # `lambda` in C
        ("distortion", c_double * 9),
    ]


class MapMemory(ctypes.Structure):
    _fields_ = [
        ("state_bytes_fp32", c_uint64),
        ("state_bytes_compact", c_uint64),
        ("conv_bytes", c_uint64),
        ("n_values", c_uint64),
        ("n_units", c_uint64),
        ("n_pivots", c_uint64),
        ("code_bytes", c_uint64),
        ("scale_bytes", c_uint64),
        ("pivot_bytes", c_uint64),
        ("dense_bytes", c_uint64),
        ("bits_per_value", c_double),
        ("ratio_vs_fp32", c_double),
    ]


class PoolConfig(_Versioned):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("map", c_void_p),
        ("backend", c_enum),
        ("device", c_int),
        ("stream", c_void_p),
        ("tp_rank", c_int),
        ("tp_size", c_int),
        ("min_page_bytes", c_uint64),
        ("page_align", c_uint64),
        ("block_align", c_uint32),
        ("policy", c_enum),
        ("num_slots", c_int32),
        ("max_running_requests", c_int32),
        ("memory_budget_bytes", c_uint64),
        ("flags", c_uint),
    ]
    _version = POOL_CONFIG_VERSION
    _defaults = {"tp_size": 1, "policy": POLICIES["extra_buffer"]}


class PoolPlanInfo(ctypes.Structure):
    _fields_ = [
        ("page_bytes", c_uint64),
        ("state_bytes", c_uint64),
        ("state_bytes_compact", c_uint64),
        ("align_bytes", c_uint64),
        ("conv_bytes", c_uint64),
        ("pad_bytes", c_uint64),
        ("slots", c_int32),
        ("pool_bytes", c_uint64),
        ("meta_bytes", c_uint64),
    ]


class PoolBufferInfo(ctypes.Structure):
    _fields_ = [
        ("ptr", c_void_p),
        ("bytes", c_uint64),
        ("item_bytes", c_uint64),
        ("name", c_char_p),
    ]


class PoolStats(ctypes.Structure):
    _fields_ = [
        ("capacity", c_int32),
        ("in_use", c_int32),
        ("available", c_int32),
        ("high_water", c_int32),
        ("n_alloc", c_uint64),
        ("n_free", c_uint64),
        ("page_bytes", c_uint64),
        ("pool_bytes", c_uint64),
        ("in_use_bytes", c_uint64),
        ("meta_bytes", c_uint64),
        ("state_bytes", c_uint64),
        ("state_bytes_compact", c_uint64),
        ("conv_bytes", c_uint64),
        ("pad_bytes", c_uint64),
        ("health_any", c_uint32),
        ("health_slots", c_int32),
    ]


class PoolLayout(ctypes.Structure):
    _fields_ = [
        ("arch", c_enum),
        ("method", c_enum),
        ("n_layers", c_int),
        ("n_local_heads", c_int),
        ("first_head", c_int),
        ("d_k", c_int),
        ("d_v", c_int),
        ("units_per_head", c_int),
        ("page_bytes", c_uint64),
        ("state_bytes", c_uint64),
        ("state_bytes_compact", c_uint64),
        ("conv_bytes", c_uint64),
        ("conv_bytes_per_layer", c_uint64),
        ("pad_bytes", c_uint64),
        ("block_offset", ctypes.POINTER(c_uint64)),
        ("block_bytes", ctypes.POINTER(c_uint32)),
        ("block_compact", ctypes.POINTER(c_uint32)),
        ("unit_bits", ctypes.POINTER(ctypes.c_uint8)),
        ("conv_offset", ctypes.POINTER(c_uint64)),
        ("n_blocks", c_int),
        ("fingerprint", c_uint64),
    ]


class StepArgs(_Versioned):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("batch", c_int32),
        ("slot_ids", c_void_p),
        ("dtype", c_enum),
        ("q", c_void_p),
        ("k", c_void_p),
        ("v", c_void_p),
        ("g", c_void_p),
        ("beta", c_void_p),
        ("o", c_void_p),
        ("q_stride", c_int64),
        ("k_stride", c_int64),
        ("v_stride", c_int64),
        ("g_stride", c_int64),
        ("beta_stride", c_int64),
        ("o_stride", c_int64),
        ("flags", c_uint),
        ("scale", c_float),
        ("A_log", c_void_p),
        ("dt_bias", c_void_p),
        ("param_dtype", c_enum),
        ("health_counts", c_void_p),
        ("num_k_heads", c_int32),
        ("num_v_heads", c_int32),
        ("head_k_dim", c_int32),
        ("head_v_dim", c_int32),
    ]
    _version = STEP_ARGS_VERSION


class PrefillArgs(_Versioned):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("n", c_int32),
        ("slot_ids", c_void_p),
        ("states", c_void_p),
        ("state_stride", c_int64),
        ("dtype", c_enum),
        ("layout", c_enum),
        ("health_counts", c_void_p),
        ("num_v_heads", c_int32),
        ("head_k_dim", c_int32),
        ("head_v_dim", c_int32),
    ]
    _version = PREFILL_ARGS_VERSION


class ConvView(ctypes.Structure):
    _fields_ = [
        ("base", c_void_p),
        ("slot_stride", c_uint64),
        ("bytes", c_uint64),
        ("dtype", c_enum),
        ("rank", c_int),
        ("shape", c_int64 * CONV_MAX_RANK),
    ]


# Every mirrored struct by its C name (the layout test walks this).
STRUCTS = {
    "stepq_map_load_config": MapLoadConfig,
    "stepq_model_shape": ModelShape,
    "stepq_unit_stats": UnitStats,
    "stepq_map_memory": MapMemory,
    "stepq_pool_config": PoolConfig,
    "stepq_pool_plan_info": PoolPlanInfo,
    "stepq_pool_buffer_info": PoolBufferInfo,
    "stepq_pool_stats": PoolStats,
    "stepq_pool_layout": PoolLayout,
    "stepq_step_args": StepArgs,
    "stepq_prefill_args": PrefillArgs,
    "stepq_conv_view": ConvView,
}
# Python field names that differ from C's (a Python keyword).
C_FIELD_NAME = {"lambda_": "lambda"}

# --- Functions --------------------------------------------------------------

_P = ctypes.POINTER
_i32p = _P(c_int32)

# name: (restype, argtypes). Maps and pools are passed as opaque c_void_p.
_SIGNATURES = {
    "stepq_status_name": (c_char_p, [c_int]),
    "stepq_strerror": (c_char_p, [c_int]),
    "stepq_last_error": (c_char_p, []),
    "stepq_version": (c_uint, []),
    "stepq_version_string": (c_char_p, []),
    "stepq_free": (None, [c_void_p]),
    # map.h
    "stepq_map_load_file": (c_int, [c_char_p, _P(MapLoadConfig), _P(c_void_p)]),
    "stepq_map_load_buffer": (c_int, [c_char_p, c_size_t, _P(MapLoadConfig), _P(c_void_p)]),
    "stepq_map_write_buffer": (c_int, [c_void_p, _P(c_void_p), _P(c_size_t)]),
    "stepq_map_close": (None, [c_void_p]),
    "stepq_map_last_error": (c_char_p, [c_void_p]),
    "stepq_map_shape": (c_int, [c_void_p, _P(ModelShape)]),
    "stepq_map_method": (c_enum, [c_void_p]),
    "stepq_map_budget_bits": (c_double, [c_void_p]),
    "stepq_map_row_split": (c_double, [c_void_p]),
    "stepq_map_decode_fit": (c_enum, [c_void_p]),
    "stepq_map_arith": (c_enum, [c_void_p]),
    "stepq_map_model_name": (c_char_p, [c_void_p]),
    "stepq_map_layer_index": (c_int, [c_void_p, c_int]),
    "stepq_map_units_per_layer": (c_int, [c_void_p]),
    "stepq_map_values_per_unit": (c_int, [c_void_p]),
    "stepq_map_unit_bits": (c_int, [c_void_p, c_int, c_int]),
    "stepq_map_unit_stats": (c_int, [c_void_p, c_int, c_int, _P(UnitStats)]),
    "stepq_map_fingerprint": (c_int, [c_void_p, _P(c_uint64)]),
    "stepq_map_memory_info": (c_int, [c_void_p, _P(MapMemory)]),
    "stepq_method_name": (c_char_p, [c_enum]),
    "stepq_arch_name": (c_char_p, [c_enum]),
    "stepq_dtype_name": (c_char_p, [c_enum]),
    "stepq_decode_fit_name": (c_char_p, [c_enum]),
    "stepq_arith_name": (c_char_p, [c_enum]),
    # pool.h
    "stepq_pool_policy_slots": (c_int, [c_enum]),
    "stepq_pool_plan": (c_int, [_P(PoolConfig), _P(PoolPlanInfo)]),
    "stepq_pool_open": (c_int, [_P(PoolConfig), _P(c_void_p)]),
    "stepq_pool_close": (c_int, [c_void_p, c_uint]),
    "stepq_pool_alloc": (c_int, [c_void_p, c_int32, _i32p]),
    "stepq_pool_free": (c_int, [c_void_p, _i32p, c_int32]),
    "stepq_pool_clear": (c_int, [c_void_p, _i32p, c_int32]),
    "stepq_pool_copy": (c_int, [c_void_p, _i32p, _i32p, c_int32]),
    "stepq_pool_copy_masked": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_int32, c_void_p]),
    "stepq_pool_copy_to_host": (c_int, [c_void_p, _i32p, c_int32, c_void_p, c_size_t]),
    "stepq_pool_copy_from_host": (c_int, [c_void_p, _i32p, c_int32, c_void_p, c_size_t]),
    "stepq_pool_sync": (c_int, [c_void_p]),
    "stepq_pool_buffer_infos": (c_int, [c_void_p, _P(PoolBufferInfo), c_int, _P(c_int)]),
    "stepq_pool_health_read": (c_int, [c_void_p, _i32p, c_int32, _P(c_uint32)]),
    "stepq_pool_get_stats": (c_int, [c_void_p, _P(PoolStats), c_size_t]),
    "stepq_pool_page": (c_int, [c_void_p, c_int32, _P(c_void_p)]),
    "stepq_pool_get_layout": (c_int, [c_void_p, _P(_P(PoolLayout))]),
    "stepq_pool_is_allocated": (c_int, [c_void_p, c_int32]),
    "stepq_pool_last_error": (c_char_p, [c_void_p]),
    # step.h
    "stepq_pool_decode_step": (c_int, [c_void_p, c_int, _P(StepArgs), c_void_p]),
    "stepq_pool_prefill_pack": (c_int, [c_void_p, c_int, _P(PrefillArgs), c_void_p]),
    "stepq_pool_prefill_unpack": (c_int, [c_void_p, c_int, _P(PrefillArgs), c_void_p]),
    "stepq_pool_supports": (c_int, [c_void_p, c_enum, c_int, c_void_p]),
    "stepq_pool_conv_state": (c_int, [c_void_p, c_int, _P(ConvView), c_size_t]),
}


def _candidates():
    env = os.environ.get("STEPQ_LIBRARY")
    if env:
        return [env]  # an explicit choice is not second-guessed
    names = ["libstepq.so.%d.%d" % (VERSION_MAJOR, VERSION_MINOR), "libstepq.so"]
    found = ctypes.util.find_library("stepq")
    if found and found not in names:
        names.append(found)
    return names


def _load():
    errors = []
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append("%s: %s" % (name, e))
            continue
        for fn, (restype, argtypes) in _SIGNATURES.items():
            f = getattr(lib, fn)  # AttributeError: a library older than these bindings
            f.restype, f.argtypes = restype, argtypes
        return lib, name
    raise ImportError("stepq: libstepq not found (set STEPQ_LIBRARY to its path): "
                      + "; ".join(errors))


lib, path = _load()


def _text(b):
    return b.decode("utf-8", "replace") if b else ""


def status_name(status):
    """The library's symbolic name of a status ("STEPQ_EINVAL")."""
    return _text(lib.stepq_status_name(status))


def strerror(status):
    """The library's short description of a status."""
    return _text(lib.stepq_strerror(status))


def last_error():
    """The calling thread's last failure detail (thread-local in the library)."""
    return _text(lib.stepq_last_error())
