"""Bad input is refused before anything changes: wrong dtype, shape,
contiguity or device raise StepqArgumentError (a ValueError and a
StepqError) naming the argument before the library is called; what only the
library can judge (slot ids that are not allocated, repeated ids) comes back
as its StepqError; no output row and no page byte changes either way."""

import sys

import _harness
from _harness import raises

import stepq

GDN6 = _harness.data("config", "calibrated", "tiny-gdn", "stepq@6.json")
KDA6 = _harness.data("config", "calibrated", "tiny-kda", "stepq@6.json")


class FakeTensor:
    """Enough of a torch tensor for the bindings' duck typing: data_ptr,
    stride, shape, dtype and device, over a numpy array (so the torch path
    runs without torch)."""

    class _Device:
        def __init__(self, type, index=None):
            self.type, self.index = type, index

    def __init__(self, arr, dtype=None, device="cpu"):
        self.arr = arr
        self.shape = arr.shape
        self.dtype = dtype or {"float32": "torch.float32", "int32": "torch.int32"}[arr.dtype.name]
        kind, _, index = device.partition(":")
        self.device = self._Device(kind, int(index) if index else None)

    def data_ptr(self):
        return self.arr.ctypes.data

    def stride(self):
        return tuple(s // self.arr.dtype.itemsize for s in self.arr.strides)

    def tolist(self):
        return self.arr.tolist()


def _setup(path=GDN6):
    np = _harness.need_numpy()
    rng = np.random.default_rng(1)
    with stepq.load_map(path) as m:
        pool = stepq.StatePool(m, size=4)
    H, HV, K, V = pool.num_k_heads, pool.num_v_heads, pool.head_k_dim, pool.head_v_dim
    ids = pool.alloc(2)
    pool.pack(0, ids, (0.05 * rng.uniform(-1, 1, (2, HV, K, V))).astype(np.float32))
    g_shape = (2, HV, K) if pool.arch == "kda" else (2, HV)
    t = dict(q=rng.uniform(-1, 1, (2, H, K)).astype(np.float32),
             k=rng.uniform(-1, 1, (2, H, K)).astype(np.float32),
             v=rng.uniform(-1, 1, (2, HV, V)).astype(np.float32),
             a=np.full(g_shape, -0.1, np.float32), b=np.full((2, HV), 0.5, np.float32),
             cache_indices=np.array(ids, np.int32), out=np.full((2, HV, V), 3.0, np.float32))
    return np, pool, ids, t


def _refused(pool, ids, t, exc, name, match, **change):
    """decode with `change` applied must raise and leave out and pages alone."""
    np = _harness.need_numpy()
    pages = pool.get_cpu_copy(ids)
    args = dict(t, **change)
    with raises(exc, name=name, match=match):
        pool.decode(0, **args)
    assert (t["out"] == 3.0).all()
    assert np.array_equal(pool.get_cpu_copy(ids), pages)


def test_wrong_dtypes_name_the_argument():
    np, pool, ids, t = _setup()
    _refused(pool, ids, t, ValueError, "STEPQ_EINVAL", "q: dtype float64", q=t["q"].astype(np.float64))
    _refused(pool, ids, t, ValueError, "STEPQ_EINVAL", "v: dtype fp16", v=t["v"].astype(np.float16))
    _refused(pool, ids, t, ValueError, "STEPQ_EINVAL", "cache_indices: dtype int64",
             cache_indices=t["cache_indices"].astype(np.int64))
    _refused(pool, ids, t, ValueError, "STEPQ_EINVAL", "out: dtype",
             out=np.zeros((2, pool.num_v_heads, pool.head_v_dim), np.float64))
    with raises(ValueError, match="A_log: dtype"):
        pool.decode(0, **t, A_log=np.zeros(pool.num_v_heads, np.float64),
                    dt_bias=np.zeros(pool.num_v_heads, np.float32))
    with raises(ValueError, match="q: a numpy array or a torch tensor"):
        pool.decode(0, **dict(t, q=t["q"].tolist()))
    pool.close(force=True)


def test_wrong_shapes_name_the_argument():
    np, pool, ids, t = _setup()
    H, HV, K, V = pool.num_k_heads, pool.num_v_heads, pool.head_k_dim, pool.head_v_dim
    _refused(pool, ids, t, ValueError, "STEPQ_ESHAPE", "k: shape",
             k=np.zeros((2, H + 1, K), np.float32))
    _refused(pool, ids, t, ValueError, "STEPQ_ESHAPE", "v: shape",
             v=np.zeros((3, HV, V), np.float32))  # a batch other than cache_indices'
    _refused(pool, ids, t, ValueError, "STEPQ_ESHAPE", "a: shape",
             a=np.zeros((2, HV, K), np.float32))  # a KDA gate on a GDN pool
    _refused(pool, ids, t, ValueError, "STEPQ_ESHAPE", "cache_indices",
             cache_indices=np.array([ids], np.int32))
    with raises(ValueError, name="STEPQ_ESHAPE", match="dt_bias: shape"):
        pool.decode(0, **t, A_log=np.zeros(HV, np.float32), dt_bias=np.zeros((HV, K), np.float32))
    with raises(ValueError, match="A_log, dt_bias"):
        pool.decode(0, **t, A_log=np.zeros(HV, np.float32))
    with raises(ValueError, name="STEPQ_ERANGE", match="layer"):
        pool.decode(pool.n_layers, **t)
    with raises(ValueError, name="STEPQ_ESHAPE", match="states: shape"):
        pool.pack(0, ids, np.zeros((2, HV, K, V + 1), np.float32))
    with raises(ValueError, match="layout"):
        pool.unpack(0, ids, layout="kvk")
    pool.close(force=True)


def test_kda_pool_wants_a_gate_per_key_channel():
    np, pool, ids, t = _setup(KDA6)
    HV = pool.num_v_heads
    _refused(pool, ids, t, ValueError, "STEPQ_ESHAPE", "a: shape", a=np.zeros((2, HV), np.float32))
    pool.decode(0, **t)  # the right shapes step
    assert not (t["out"] == 3.0).all()
    pool.close(force=True)


def test_non_contiguous_requests_are_refused():
    np, pool, ids, t = _setup()
    H, K = pool.num_k_heads, pool.head_k_dim
    wide = np.zeros((2, H, 2 * K), np.float32)
    _refused(pool, ids, t, ValueError, "STEPQ_EINVAL", "q: each request", q=wide[:, :, ::2])
    # Requests closer than one request's elements (overlapping rows).
    flat = np.zeros(H * K + 8, np.float32)
    overlap = np.lib.stride_tricks.as_strided(flat, (2, H * K), (32, 4))
    _refused(pool, ids, t, ValueError, "STEPQ_EINVAL", "q: requests are 8 elements apart", q=overlap)
    _refused(pool, ids, t, ValueError, "STEPQ_EINVAL", "cache_indices",
             cache_indices=np.array(ids * 2, np.int32)[::2])
    pool.close(force=True)


def test_tensors_on_another_device_are_refused():
    np, pool, ids, t = _setup()
    _refused(pool, ids, t, ValueError, "STEPQ_EINVAL", "q: on cuda:0",
             q=FakeTensor(t["q"], device="cuda:0"))
    # torch tensors on the CPU are the host backend's too.
    args = {n: FakeTensor(x) for n, x in t.items()}
    pool.decode(0, **args)
    assert not (t["out"] == 3.0).all()
    pool.close(force=True)


def test_slot_ids_the_library_refuses_change_nothing():
    np, pool, ids, t = _setup()
    pool.free(ids[1])
    _refused(pool, ids[:1], t, stepq.StepqError, "STEPQ_EINVAL", "slot_ids[1]",
             cache_indices=np.array([ids[0], ids[1]], np.int32))  # a freed slot
    pool.alloc(1)
    _refused(pool, ids[:1], t, stepq.StepqError, "STEPQ_EINVAL", None,
             cache_indices=np.array([ids[0], ids[0]], np.int32))  # listed twice
    _refused(pool, ids[:1], t, stepq.StepqError, "STEPQ_ERANGE", "99",
             cache_indices=np.array([ids[0], 99], np.int32))  # out of range
    with raises(ValueError, match="ids[1]"):
        pool.free([ids[0], "x"])
    with raises(ValueError, match="bool"):
        pool.free(True)
    pool.close(force=True)


if __name__ == "__main__":
    sys.exit(_harness.main(dict(globals())))
