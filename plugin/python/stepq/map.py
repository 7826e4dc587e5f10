"""Precision maps (stepq/map.h)."""

import ctypes
import os
import threading

from . import _lib
from .errors import StepqError, check

lib = _lib.lib


class Map:
    """A loaded precision map: the per-checkpoint description of how each
    recurrent-state unit is stored. Immutable once loaded, so it may be read
    from any number of threads; ``close()`` must not race with its use (as
    stepq_map_close). Use ``load_map()`` to make one; ``with`` closes it.

    Shape attributes (whole model, before tensor parallelism): ``arch``
    ("gdn" | "kda"), ``n_layers``, ``layer_ids``, ``num_k_heads`` (H),
    ``num_v_heads`` (HV), ``head_k_dim`` (K), ``head_v_dim`` (V),
    ``conv_shape`` (tuple), ``conv_dtype`` ("bf16", ...); and ``method``,
    ``budget_bits``, ``row_split`` (the dual-axis fit's row split: 0.5 unless
    the map's ``row_split`` field says otherwise), ``decode_fit`` (the decode
    step's fit, "exact", "norefit" or "rows": "exact" unless the map's ``decode_fit``
    field says otherwise), ``arith`` (the decode step's arithmetic, "fp32" or "fp16":
    "fp32" unless the map's ``arith`` field says otherwise), ``model_name``.
    """

    def __init__(self, handle, path=None):
        self._h = handle
        self._lock = threading.Lock()
        self.path = path
        sh = _lib.ModelShape()
        check(lib.stepq_map_shape(self._h, ctypes.byref(sh)))
        self.arch = _lib.ARCHS[sh.arch]
        self.n_layers = sh.n_layers
        self.layer_ids = tuple(sh.layer_ids[i] for i in range(sh.n_layers))
        self.num_k_heads, self.num_v_heads = sh.num_k_heads, sh.num_v_heads
        self.head_k_dim, self.head_v_dim = sh.head_k_dim, sh.head_v_dim
        self.conv_shape = tuple(sh.conv_shape[i] for i in range(sh.conv_rank))
        self.conv_dtype = _lib._text(lib.stepq_dtype_name(sh.conv_dtype))
        self.method = _lib._text(lib.stepq_method_name(lib.stepq_map_method(self._h)))
        self.budget_bits = lib.stepq_map_budget_bits(self._h)
        self.row_split = lib.stepq_map_row_split(self._h)
        self.decode_fit = _lib._text(lib.stepq_decode_fit_name(lib.stepq_map_decode_fit(self._h)))
        self.arith = _lib._text(lib.stepq_arith_name(lib.stepq_map_arith(self._h)))
        self.model_name = _lib._text(lib.stepq_map_model_name(self._h))

    @property
    def handle(self):
        """The stepq_map_t * as an int (raises StepqError once closed)."""
        if self._h is None:
            raise StepqError("STEPQ_EBADF", "the map is closed")
        return self._h

    def close(self):
        """Releases the map. Pools opened on it stay valid (they copied the layout)."""
        with self._lock:
            h, self._h = self._h, None
        if h is not None:
            lib.stepq_map_close(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_h", None) is not None and lib is not None:
            self.close()

    def __repr__(self):
        return "<stepq.Map %s %s %s@%g, %d layers, H=%d HV=%d %dx%d>" % (
            self.model_name or "?", self.arch, self.method, self.budget_bits, self.n_layers,
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def layer_index(self, model_layer_id):
        """The recurrent-layer index (0..n_layers-1) of a model layer id
        (StepqError STEPQ_ENOENT when that layer is not recurrent)."""
        return check(lib.stepq_map_layer_index(self.handle, model_layer_id))

    @property
    def units_per_layer(self):
        """HV (GDN) or HV * K (KDA)."""
        return check(lib.stepq_map_units_per_layer(self.handle))

    def unit_bits(self, layer, unit):
        """Bit width of one unit (2..8, 16 for a pivot, 0 for dense maps and fp8)."""
        return check(lib.stepq_map_unit_bits(self.handle, layer, unit))

    def unit_stats(self, layer, unit):
        """Calibration statistics of a unit as a dict (log_retention, lambda,
        distortion: {bits: value}), or None when the map has none."""
        s = _lib.UnitStats()
        st = lib.stepq_map_unit_stats(self.handle, layer, unit, ctypes.byref(s))
        if st == _lib.ENOENT:
            return None
        check(st)
        return {"log_retention": s.log_retention, "lambda": s.lambda_,
                "distortion": {b: s.distortion[b] for b in range(9) if s.distortion[b] >= 0}}

    def fingerprint(self):
        """The 64-bit fingerprint of everything that decides the stored bytes."""
        out = ctypes.c_uint64()
        check(lib.stepq_map_fingerprint(self.handle, ctypes.byref(out)))
        return out.value

    def memory_info(self):
        """Exact per-request byte counts (stepq_map_memory) as a dict."""
        m = _lib.MapMemory()
        check(lib.stepq_map_memory_info(self.handle, ctypes.byref(m)))
        return {name: getattr(m, name) for name, _ in m._fields_}

    def to_json(self):
        """The map serialized (deterministic JSON, schema v1) as a str."""
        buf, n = ctypes.c_void_p(), ctypes.c_size_t()
        check(lib.stepq_map_write_buffer(self.handle, ctypes.byref(buf), ctypes.byref(n)))
        try:
            return ctypes.string_at(buf.value, n.value).decode("utf-8")
        finally:
            lib.stepq_free(buf)


def load_map(path, max_bytes=0, max_values=0):
    """Loads and validates a precision map file (stepq_map_load_file).

    max_bytes / max_values: the load limits of stepq_map_load_config (0 =
    the library's defaults). Raises StepqError naming the JSON path and the
    reason (STEPQ_EIO, STEPQ_EPARSE, STEPQ_ESCHEMA, ...).
    """
    cfg = _lib.MapLoadConfig.new(max_bytes=max_bytes, max_values=max_values)
    h = ctypes.c_void_p()
    check(lib.stepq_map_load_file(os.fsencode(path), ctypes.byref(cfg), ctypes.byref(h)))
    return Map(h.value, path)


def load_map_buffer(data, max_bytes=0, max_values=0):
    """Loads a map from JSON text (str or bytes)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    cfg = _lib.MapLoadConfig.new(max_bytes=max_bytes, max_values=max_values)
    h = ctypes.c_void_p()
    check(lib.stepq_map_load_buffer(data, len(data), ctypes.byref(cfg), ctypes.byref(h)))
    return Map(h.value)
