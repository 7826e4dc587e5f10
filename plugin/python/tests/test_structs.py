"""Every ctypes struct of stepq._lib against the C headers: size, each
field's offset and size, the bytes the versioned structs' INITIALIZERs give
them, and the copied constants (tests/python/struct_layout.c prints what the
compiler sees; STEPQ_STRUCT_LAYOUT names the built program)."""

import ctypes
import os
import subprocess
import sys

import _harness

import stepq
from stepq import _lib


def _layout():
    exe = os.environ.get("STEPQ_STRUCT_LAYOUT")
    if not exe or not os.path.exists(exe):
        _harness.skip("STEPQ_STRUCT_LAYOUT does not name the built struct_layout program")
    out = subprocess.run([exe], check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
    structs, fields, inits, consts = {}, {}, {}, {}
    for line in out.splitlines():
        kind, name, *rest = line.split()
        if kind == "struct":
            structs[name] = int(rest[0])
        elif kind == "field":
            fields[name] = (int(rest[0]), int(rest[1]))
        elif kind == "init":
            inits[name] = bytes.fromhex(rest[0])
        elif kind == "const":
            consts[name] = int(rest[0])
    return structs, fields, inits, consts


def test_every_struct_has_the_size_and_field_offsets_of_the_header():
    structs, fields, _, _ = _layout()
    assert set(structs) == set(_lib.STRUCTS), sorted(set(structs) ^ set(_lib.STRUCTS))
    for cname, cls in _lib.STRUCTS.items():
        assert ctypes.sizeof(cls) == structs[cname], (cname, ctypes.sizeof(cls), structs[cname])
        c_fields = {k.split(".", 1)[1]: v for k, v in fields.items() if k.split(".")[0] == cname}
        py_fields = [_lib.C_FIELD_NAME.get(n, n) for n, _ in cls._fields_]
        # Same fields in the same order (the C program lists them in declaration order).
        assert py_fields == list(c_fields), (cname, py_fields, list(c_fields))
        for pyname, _ in cls._fields_:
            d = getattr(cls, pyname)
            assert (d.offset, d.size) == c_fields[_lib.C_FIELD_NAME.get(pyname, pyname)], \
                (cname, pyname, d.offset, d.size)


def test_versioned_structs_start_as_their_initializers():
    _, _, inits, _ = _layout()
    by_c = {"stepq_map_load_config": _lib.MapLoadConfig, "stepq_pool_config": _lib.PoolConfig,
            "stepq_step_args": _lib.StepArgs, "stepq_prefill_args": _lib.PrefillArgs}
    assert set(inits) == set(by_c)
    for cname, cls in by_c.items():
        assert bytes(cls.new()) == inits[cname], cname


def test_constants_and_status_names_match_the_library():
    _, _, _, consts = _layout()
    mine = {
        "STEPQ_CONFIG_MAGIC": _lib.CONFIG_MAGIC,
        "STEPQ_VERSION_MAJOR": _lib.VERSION_MAJOR,
        "STEPQ_VERSION_MINOR": _lib.VERSION_MINOR,
        "STEPQ_POOL_CONFIG_VERSION": _lib.POOL_CONFIG_VERSION,
        "STEPQ_MAP_LOAD_CONFIG_VERSION": _lib.MAP_LOAD_CONFIG_VERSION,
        "STEPQ_STEP_ARGS_VERSION": _lib.STEP_ARGS_VERSION,
        "STEPQ_PREFILL_ARGS_VERSION": _lib.PREFILL_ARGS_VERSION,
        "STEPQ_POOL_SLOT_SENTINEL": _lib.SLOT_SENTINEL,
        "STEPQ_POOL_SLOT_PAD": _lib.SLOT_PAD,
        "STEPQ_POOL_BACKEND_HOST": _lib.BACKEND_HOST,
        "STEPQ_POOL_BACKEND_CUDA": _lib.BACKEND_CUDA,
        "STEPQ_POOL_FLAG_CLEAR_ON_ALLOC": _lib.POOL_FLAG_CLEAR_ON_ALLOC,
        "STEPQ_POOL_CLOSE_FORCE": _lib.POOL_CLOSE_FORCE,
        "STEPQ_STEP_L2NORM": _lib.STEP_L2NORM,
        "STEPQ_STEP_GATE_IN_KERNEL": _lib.STEP_GATE_IN_KERNEL,
        "STEPQ_STEP_BETA_SIGMOID": _lib.STEP_BETA_SIGMOID,
        "STEPQ_STATE_LAYOUT_KV": _lib.LAYOUT_KV,
        "STEPQ_STATE_LAYOUT_VK": _lib.LAYOUT_VK,
        "STEPQ_OP_DECODE_STEP": _lib.OP_DECODE_STEP,
        "STEPQ_OP_PREFILL_PACK": _lib.OP_PREFILL_PACK,
        "STEPQ_OP_PREFILL_UNPACK": _lib.OP_PREFILL_UNPACK,
        "STEPQ_CONV_MAX_RANK": _lib.CONV_MAX_RANK,
        "STEPQ_BITS_PIVOT": _lib.BITS_PIVOT,
        "STEPQ_BITS_DENSE": _lib.BITS_DENSE,
        "STEPQ_HEALTH_INPUT": _lib.HEALTH_INPUT,
        "STEPQ_HEALTH_STATE": _lib.HEALTH_STATE,
        "STEPQ_HEALTH_SATURATED": _lib.HEALTH_SATURATED,
        "STEPQ_HEALTH_OUTPUT": _lib.HEALTH_OUTPUT,
    }
    mine.update({"STEPQ_POOL_POLICY_" + k.upper(): v for k, v in _lib.POLICIES.items()})
    mine.update({"STEPQ_ARCH_" + v.upper(): k for k, v in _lib.ARCHS.items()})
    mine.update({"STEPQ_DTYPE_" + k.upper(): v for k, v in _lib.DTYPES.items()})
    mine.update(_lib.STATUS)
    assert set(mine) == set(consts), sorted(set(mine) ^ set(consts))
    for name, value in mine.items():
        assert consts[name] == value, (name, value, consts[name])
    for name, value in _lib.STATUS.items():
        assert _lib.status_name(value) == name, (name, _lib.status_name(value))
    for name, value in _lib.DTYPES.items():
        assert _lib._text(_lib.lib.stepq_dtype_name(value)) == name
    assert stepq.library_version() == "%d.%d.%d" % (
        consts["STEPQ_VERSION_MAJOR"], consts["STEPQ_VERSION_MINOR"],
        _lib.lib.stepq_version() & 0xFF)


if __name__ == "__main__":
    sys.exit(_harness.main(dict(globals())))
