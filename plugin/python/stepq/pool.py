"""The recurrent-state pool (stepq/pool.h) and its data path (stepq/step.h),
shaped like SGLang's state pool: the slot allocator's ``alloc`` / ``free`` /
``available_size`` / ``clear`` and MambaPool's ``clear_slots``,
``copy_from``, ``get_cpu_copy`` / ``load_cpu_copy`` and
``get_contiguous_buf_infos``, plus per-layer ``decode`` and ``extend``.
"""

import ctypes
import operator
import sys
import threading

from . import _lib
from . import _tensor as T
from .errors import StepqError, bad_arg, check

lib = _lib.lib

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_LAYOUTS = {"kv": _lib.LAYOUT_KV, "vk": _lib.LAYOUT_VK}


def _parse_device(device):
    """"cpu" -> ("cpu", None); "cuda", "cuda:N", a torch.device -> ("cuda", N)."""
    if hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        device = device.type if device.index is None else "%s:%d" % (device.type, device.index)
    if not isinstance(device, str):
        raise bad_arg("device: %r is not \"cpu\", \"cuda\" or \"cuda:N\"" % (device,))
    if device == "cpu":
        return "cpu", None
    if device == "cuda":
        return "cuda", 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", int(device[5:])
    raise bad_arg("device: %r is not \"cpu\", \"cuda\" or \"cuda:N\"" % (device,))


def _host_ids(ids, name):
    """A slot-id list (int, sequence, numpy array, torch tensor on any
    device) as a ctypes int32 array and its length. Host bookkeeping reads
    ids on the host, as SGLang's allocator does."""
    if isinstance(ids, bool):
        raise bad_arg("%s: a slot id or a list of them, not a bool" % name)
    if isinstance(ids, int) or hasattr(ids, "__index__") and not hasattr(ids, "tolist"):
        ids = [ids]
    elif hasattr(ids, "tolist"):
        ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
    try:
        ids = list(ids)
    except TypeError:
        raise bad_arg("%s: a slot id or a list of them, not %s" % (name, type(ids).__name__)) from None
    for i, x in enumerate(ids):
        try:
            if isinstance(x, bool):
                raise TypeError
            ids[i] = x = operator.index(x)  # ints and numpy integers
        except TypeError:
            raise bad_arg("%s[%d]: %r is not an integer slot id" % (name, i, x)) from None
        if not _INT32_MIN <= x <= _INT32_MAX:
            raise bad_arg("%s[%d]: %d is outside int32" % (name, i, x), "STEPQ_ERANGE")
    if len(ids) > _INT32_MAX:
        raise bad_arg("%s: %d ids, more than int32 holds" % (name, len(ids)), "STEPQ_ERANGE")
    return (ctypes.c_int32 * len(ids))(*ids), len(ids)


def _pool_config(map, size, device, policy, max_running_requests, memory_budget_bytes, stream,
                 clear_on_alloc, tp_rank, tp_size, min_page_bytes, page_align, block_align):
    """The stepq_pool_config of StatePool's and plan_pool's arguments, and the parsed device."""
    if not hasattr(type(map), "handle"):
        raise bad_arg("map: a stepq.Map (stepq.load_map), not %s" % type(map).__name__)
    kind, index = _parse_device(device)
    if policy not in _lib.POLICIES:
        raise bad_arg("policy: %r is not one of %s" % (policy, ", ".join(_lib.POLICIES)))
    sizing = [x is not None for x in (size, max_running_requests, memory_budget_bytes)]
    if sum(sizing) != 1:
        raise bad_arg("size, max_running_requests, memory_budget_bytes: set exactly one")
    for name, x in (("size", size), ("max_running_requests", max_running_requests),
                    ("memory_budget_bytes", memory_budget_bytes)):
        if x is None:
            continue
        try:
            if isinstance(x, bool):
                raise TypeError
            v = operator.index(x)
        except TypeError:
            v = None
        if v is None or v < 1:
            raise bad_arg("%s: %r, need an integer >= 1" % (name, x))
    cfg = _lib.PoolConfig.new(
        map=map.handle,
        backend=_lib.BACKEND_CUDA if kind == "cuda" else _lib.BACKEND_HOST,
        device=index or 0, stream=stream, tp_rank=tp_rank, tp_size=tp_size,
        min_page_bytes=min_page_bytes, page_align=page_align, block_align=block_align,
        policy=_lib.POLICIES[policy],
        num_slots=size or 0, max_running_requests=max_running_requests or 0,
        memory_budget_bytes=memory_budget_bytes or 0,
        flags=_lib.POOL_FLAG_CLEAR_ON_ALLOC if clear_on_alloc else 0)
    return cfg, kind, index


def plan_pool(map, size=None, device="cpu", *, policy="extra_buffer", max_running_requests=None,
              memory_budget_bytes=None, tp_rank=0, tp_size=1, min_page_bytes=0, page_align=0,
              block_align=0):
    """What StatePool(map, ...) with these arguments would allocate, computed
    without allocating anything (stepq_pool_plan): a dict of page_bytes (the
    page stride: state_bytes + conv_bytes + pad_bytes), state_bytes,
    state_bytes_compact, align_bytes, conv_bytes, pad_bytes, slots (usable,
    the sentinel excluded), pool_bytes ((slots + 1) x page_bytes) and
    meta_bytes (health words, layout tables and, on the CUDA backend, kernel
    descriptors). A server sizes its state pool by these bytes, not by the
    dense state's. Raises what StatePool would for the same arguments
    (the same validation), without needing a device for "cuda"."""
    cfg, _, _ = _pool_config(map, size, device, policy, max_running_requests, memory_budget_bytes,
                             None, False, tp_rank, tp_size, min_page_bytes, page_align, block_align)
    info = _lib.PoolPlanInfo()
    check(lib.stepq_pool_plan(ctypes.byref(cfg), ctypes.byref(info)))
    return {name: getattr(info, name) for name, _ in info._fields_}


def _numpy():
    import numpy

    return numpy


def _torch():
    return sys.modules.get("torch")


class StatePool:
    """A compressed recurrent-state pool: ``size`` usable slots plus the
    sentinel slot 0, one page per slot holding every recurrent layer's packed
    state (and conv state) of one request on this tensor-parallel rank.

    Args:
        map: a stepq.Map (read during construction only; the pool copies the
            layout, so the map may be closed afterwards).
        size: usable slots (the sentinel excluded), as SGLang's MambaPool
            `size`. Exactly one of size, max_running_requests (times the
            policy's slots per request) and memory_budget_bytes sizes the pool.
        device: "cpu" (host backend: the C reference, numpy arrays or CPU
            torch tensors) or "cuda" / "cuda:N" (CUDA backend: torch tensors
            on that device).
        policy: "no_cache" (1 slot per request), "no_buffer" (3), "lazy"
            (4) or "extra_buffer" (5, the default).
        stream: a cudaStream_t (int) for the pool's own operations (clear,
            copy, host copies); None = the default stream. Data-path calls
            take the current torch stream instead (see ``decode``).
        clear_on_alloc: zero each page when it is allocated.
        tp_rank, tp_size, min_page_bytes, page_align, block_align: as in
            stepq_pool_config.

    Raises StepqError (e.g. STEPQ_ENOTSUP for "cuda" in a build without
    CUDA, STEPQ_ENODEV without a device).

    Thread safety: as the C API gives it, every method may be called from
    several threads and each library call is atomic with respect to the
    others. ``alloc``, ``free`` and ``clear`` also share one lock of this
    object, so ``clear`` (several library calls) is atomic with respect to
    them when they go through the same StatePool.

    Slot ids: -1 in any list is padding and skipped; slot 0 is never handed
    out. Errors change nothing and raise StepqError(name, message).
    """

    def __init__(self, map, size=None, device="cpu", *, policy="extra_buffer",
                 max_running_requests=None, memory_budget_bytes=None, stream=None,
                 clear_on_alloc=False, tp_rank=0, tp_size=1, min_page_bytes=0, page_align=0,
                 block_align=0):
        cfg, kind, index = _pool_config(map, size, device, policy, max_running_requests,
                                        memory_budget_bytes, stream, clear_on_alloc, tp_rank, tp_size,
                                        min_page_bytes, page_align, block_align)
        h = ctypes.c_void_p()
        check(lib.stepq_pool_open(ctypes.byref(cfg), ctypes.byref(h)))
        self._h = h.value
        self._lock = threading.RLock()
        self.device = "cpu" if kind == "cpu" else ("cuda", index)
        self.arch = map.arch
        tp = max(tp_size, 1)
        self.n_layers = map.n_layers
        self.num_k_heads = map.num_k_heads // tp  # H of this rank
        self.num_v_heads = map.num_v_heads // tp  # HV of this rank
        self.head_k_dim, self.head_v_dim = map.head_k_dim, map.head_v_dim
        s = self.stats()
        self.size = s["capacity"]
        self.page_bytes = s["page_bytes"]

    # --- handle ---------------------------------------------------------

    @property
    def handle(self):
        """The stepq_pool_t * as an int (StepqError STEPQ_EBADF once closed)."""
        h = self._h
        if h is None:
            raise StepqError("STEPQ_EBADF", "the pool is closed")
        return h

    def close(self, force=False):
        """Closes the pool. With slots still allocated: StepqError
        STEPQ_EBUSY and the pool stays open, unless force."""
        with self._lock:
            if self._h is None:
                return
            st = lib.stepq_pool_close(self._h, _lib.POOL_CLOSE_FORCE if force else 0)
            if st != _lib.STATUS["STEPQ_EBUSY"]:
                self._h = None  # closed, even when a CUDA failure is reported
            check(st)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=True)

    def __del__(self):
        if getattr(self, "_h", None) is not None and lib is not None:
            try:
                self.close(force=True)
            except StepqError:
                pass

    def __repr__(self):
        return "<stepq.StatePool %s, %d slots of %d B>" % (
            T._dev(self.device), self.size, self.page_bytes)

    # --- the slot allocator ---------------------------------------------

    def alloc(self, need_size=1):
        """Allocates need_size slots, all or nothing: a list of distinct slot
        ids in 1..size, or None when fewer are free (as SGLang's allocator).
        Other failures raise StepqError."""
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
            raise bad_arg("need_size: %r is not a count >= 0" % (need_size,))
        if need_size > _INT32_MAX:
            return None
        ids = (ctypes.c_int32 * need_size)()
        with self._lock:
            st = lib.stepq_pool_alloc(self.handle, need_size, ids)
        if st == _lib.ENOSPC:
            return None
        check(st)
        return list(ids)

    def free(self, ids):
        """Frees slots (an id, a list, a numpy array or a tensor; -1 skipped).
        Nothing is freed on error: STEPQ_EDOUBLEFREE (not allocated, or listed
        twice), STEPQ_EINVAL (slot 0), STEPQ_ERANGE (out of range)."""
        arr, n = _host_ids(ids, "ids")
        with self._lock:
            check(lib.stepq_pool_free(self.handle, arr, n))

    def available_size(self):
        """Free slots."""
        return self.stats()["available"]

    def clear(self):
        """Frees every allocated slot (the allocator's reset)."""
        with self._lock:
            h = self.handle
            ids = [s for s in range(1, self.size + 1) if check(lib.stepq_pool_is_allocated(h, s))]
            arr, n = _host_ids(ids, "ids")
            check(lib.stepq_pool_free(h, arr, n))

    def is_allocated(self, slot):
        """Whether a slot is allocated (StepqError for an id out of range)."""
        return bool(check(lib.stepq_pool_is_allocated(self.handle, slot)))

    # --- MambaPool's operations -----------------------------------------

    def clear_slots(self, ids):
        """Zeroes the pages and health words of allocated slots (-1 skipped)."""
        arr, n = _host_ids(ids, "ids")
        check(lib.stepq_pool_clear(self.handle, arr, n))

    def copy_from(self, src, dst):
        """Copies whole packed pages src[i] -> dst[i] (prefix copy-on-write,
        track copies); all allocated, destinations distinct and never also
        sources; a pair with a -1 is skipped."""
        s, ns = _host_ids(src, "src")
        d, nd = _host_ids(dst, "dst")
        if ns != nd:
            raise bad_arg("src, dst: %d and %d ids; the lists pair up" % (ns, nd), "STEPQ_ESHAPE")
        check(lib.stepq_pool_copy(self.handle, s, d, ns))

    def copy_masked(self, src, dst, mask=None, stream=None):
        """Copies whole pages src[i] -> dst[i] where mask[i] != 0
        (stepq_pool_copy_masked): the extra-buffer strategy's track copy as
        a CUDA graph can capture it. src, dst (and mask) are n int32 in the
        pool's memory: int32 tensors on the pool's device for a CUDA pool,
        read when the copy runs, with no host synchronisation; numpy arrays
        or lists for a host pool. Entries whose ids are outside 1..size or
        equal are skipped; the allocator is not consulted, so the ids are
        the caller's to keep valid (stepq/pool.h says what overlapping
        destinations leave). stream: a cudaStream_t, None = torch's current
        stream of the pool's device when torch is loaded."""
        s = self._slot_ids(src, "src")
        d = self._slot_ids(dst, "dst")
        if s.shape[0] != d.shape[0]:
            raise bad_arg("src, dst: %d and %d ids; the lists pair up" % (s.shape[0], d.shape[0]),
                          "STEPQ_ESHAPE")
        m = None
        if mask is not None:
            m = self._slot_ids(mask, "mask")
            if m.shape[0] != s.shape[0]:
                raise bad_arg("mask: %d entries for %d ids" % (m.shape[0], s.shape[0]), "STEPQ_ESHAPE")
        check(lib.stepq_pool_copy_masked(self.handle, s.ptr or None, d.ptr or None,
                                         m.ptr if m is not None else None, s.shape[0],
                                         self._stream(stream)))

    def fork_from(self, src):
        """Allocates one slot and copies slot src's page into it (radix
        copy-on-write); the new slot id, or None when the pool is full."""
        dst = self.alloc(1)
        if dst is None:
            return None
        try:
            self.copy_from([src], dst)
        except BaseException:
            self.free(dst)
            raise
        return dst[0]

    def get_cpu_copy(self, ids):
        """The pages of ids as a host numpy uint8 array [len(ids), page_bytes]
        (host offload); rows of -1 entries are zero. Synchronises the
        pool's stream on the CUDA backend."""
        np = _numpy()
        arr, n = _host_ids(ids, "ids")
        out = np.zeros((n, self.page_bytes), dtype=np.uint8)
        h = self.handle
        check(lib.stepq_pool_copy_to_host(h, arr, n, out.ctypes.data, out.nbytes))
        check(lib.stepq_pool_sync(h))
        return out

    def load_cpu_copy(self, cpu_copy, ids):
        """Reloads pages from get_cpu_copy()'s array into allocated slots
        (row i into ids[i]; -1 skipped); health words are reset. Waits for
        the copies on the CUDA backend."""
        arr, n = _host_ids(ids, "ids")
        v = T.view(cpu_copy, "cpu_copy", "cpu", ("uint8",))
        T.exact(v, (n, self.page_bytes), "one page per id")
        h = self.handle
        check(lib.stepq_pool_copy_from_host(h, arr, n, ctypes.c_void_p(v.ptr), n * self.page_bytes))
        check(lib.stepq_pool_sync(h))

    def buffer_infos(self):
        """The pool's contiguous buffers: a list of dicts (name, ptr, bytes,
        item_bytes): "pages" ((size + 1) pages) and "health" ((size + 1)
        uint32 words); item i is at ptr + i * item_bytes (device memory on
        the CUDA backend)."""
        count = ctypes.c_int()
        infos = (_lib.PoolBufferInfo * 4)()
        check(lib.stepq_pool_buffer_infos(self.handle, infos, len(infos), ctypes.byref(count)))
        return [{"name": _lib._text(i.name), "ptr": i.ptr or 0, "bytes": i.bytes,
                 "item_bytes": i.item_bytes} for i in infos[:count.value]]

    def get_contiguous_buf_infos(self):
        """(data_ptrs, data_lens, item_lens) of the pool's contiguous buffers
        (the packed pages, then the health words), for prefill/decode
        disaggregation transfers: slot s's item of buffer j is at
        data_ptrs[j] + s * item_lens[j]."""
        infos = self.buffer_infos()
        return ([i["ptr"] for i in infos], [i["bytes"] for i in infos],
                [i["item_bytes"] for i in infos])

    def health(self, ids):
        """The health words (STEPQ_HEALTH_* bits) of ids, a list of ints."""
        arr, n = _host_ids(ids, "ids")
        out = (ctypes.c_uint32 * n)()
        check(lib.stepq_pool_health_read(self.handle, arr, n, out))
        return list(out)

    def stats(self):
        """Pool counters (stepq_pool_stats) as a dict."""
        s = _lib.PoolStats()
        check(lib.stepq_pool_get_stats(self.handle, ctypes.byref(s), ctypes.sizeof(s)))
        return {name: getattr(s, name) for name, _ in s._fields_}

    def sync(self):
        """Waits for the pool's stream (host backend: no-op)."""
        check(lib.stepq_pool_sync(self.handle))

    def layout(self):
        """The page layout (stepq_pool_layout) as a dict: arch, method,
        n_layers, n_local_heads, first_head, d_k, d_v, units_per_head, the
        byte counts, n_blocks, fingerprint (equal on both ends of a page
        transfer: compare it before moving pages between pools) and the
        per-block lists block_offset, block_bytes, block_compact, conv_offset
        (block i = layer * n_local_heads + local head)."""
        lp = ctypes.POINTER(_lib.PoolLayout)()
        check(lib.stepq_pool_get_layout(self.handle, ctypes.byref(lp)))
        l = lp.contents
        out = {name: getattr(l, name) for name, _ in l._fields_
               if name not in ("block_offset", "block_bytes", "block_compact", "unit_bits",
                               "conv_offset")}
        out["arch"] = _lib.ARCHS[l.arch]
        out["method"] = _lib._text(lib.stepq_method_name(l.method))
        nb = l.n_blocks
        out["block_offset"] = l.block_offset[:nb] if nb else []
        out["block_bytes"] = l.block_bytes[:nb] if nb else []
        out["block_compact"] = l.block_compact[:nb] if nb else []
        out["conv_offset"] = l.conv_offset[:l.n_layers] if l.conv_offset else []
        return out

    def page_address(self, slot):
        """Address of a slot's page (slot 0 allowed)."""
        p = ctypes.c_void_p()
        check(lib.stepq_pool_page(self.handle, slot, ctypes.byref(p)))
        return p.value or 0

    def conv_state(self, layer):
        """Where layer's conv states live: a dict (base, slot_stride, bytes,
        dtype, shape); slot s's state is at base + s * slot_stride. On the
        host backend (with numpy) "array" is also a numpy view [size + 1, *shape] of them
        (bf16 and fp16 as uint16 / float16), written in place by the server's
        conv kernel; like every address here it is valid while the pool is
        open, and the view does not keep the pool open."""
        cv = _lib.ConvView()
        check(lib.stepq_pool_conv_state(self.handle, layer, ctypes.byref(cv), ctypes.sizeof(cv)))
        out = {"base": cv.base or 0, "slot_stride": cv.slot_stride, "bytes": cv.bytes,
               "dtype": _lib._text(lib.stepq_dtype_name(cv.dtype)),
               "shape": tuple(cv.shape[i] for i in range(cv.rank))}
        try:
            np = _numpy() if self.device == "cpu" and cv.rank and cv.base else None
        except ImportError:
            np = None  # the addresses alone
        if np is not None:
            dt = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[out["dtype"]]
            item = np.dtype(dt).itemsize
            strides, acc = [], item
            for d in reversed(out["shape"]):
                strides.insert(0, acc)
                acc *= d
            n = self.size + 1
            buf = (ctypes.c_char * ((n - 1) * cv.slot_stride + cv.bytes)).from_address(cv.base)
            out["array"] = np.ndarray((n,) + out["shape"], dtype=dt, buffer=buf,
                                      strides=[cv.slot_stride] + strides)
        return out

    # --- the data path --------------------------------------------------

    def _layer(self, layer):
        try:
            if isinstance(layer, bool):
                raise TypeError
            layer = operator.index(layer)  # ints and numpy integers
        except TypeError:
            raise bad_arg("layer: %r is not a recurrent-layer index" % (layer,)) from None
        if not 0 <= layer < self.n_layers:
            raise bad_arg("layer: %d is not in 0..%d (a recurrent-layer index; "
                          "Map.layer_index() maps a model layer id)" % (layer, self.n_layers - 1),
                          "STEPQ_ERANGE")
        return layer

    def _stream(self, stream):
        if stream is not None or self.device == "cpu":
            return stream
        torch = _torch()
        if torch is None:
            return None  # the pool's configured stream
        return torch.cuda.current_stream(self.device[1]).cuda_stream

    def _slot_ids(self, ids, name="cache_indices"):
        """Slot ids for the data path: host int32 memory (host backend), an
        int32 tensor on the pool's device (CUDA backend), as a View;
        the view holds a converted copy alive."""
        if self.device == "cpu" and not (hasattr(ids, "__array_interface__") or hasattr(ids, "data_ptr")):
            np = _numpy()
            arr, n = _host_ids(ids, name)
            ids = np.frombuffer(arr, dtype=np.int32) if n else np.zeros(0, np.int32)
        v = T.view(ids, name, self.device, ("int32",))
        if len(v.shape) != 1:
            raise bad_arg("%s: expected a 1-D int32 tensor, got shape %s"
                          % (name, list(v.shape)), "STEPQ_ESHAPE")
        if v.shape[0] > 1 and v.strides[0] != 1:
            raise bad_arg("%s: must be contiguous (stride %d)" % (name, v.strides[0]))
        return v

    def decode(self, layer, q, k, v, a, b, A_log=None, dt_bias=None, cache_indices=None,
               out=None, *, scale=None, l2norm=True, beta_sigmoid=None, stream=None):
        """One decode token of recurrent layer `layer` for a batch of slots
        (stepq_pool_decode_step): each slot's state is reconstructed from
        its packed page, stepped and packed back; returns `out`.

        Shapes (this rank's H q/k heads, HV value heads, K, V; B requests):
        q, k [B, H, K]; v, out [B, HV, V]; a: GDN [B, HV], KDA [B, HV, K];
        b [B, HV]; A_log [HV]; dt_bias: GDN [HV], KDA [HV, K]. A tensor may
        also be [B, prod(rest)], and requests may be any stride apart when
        each request's elements are contiguous (views of a fused projection).
        q, k, v, a, b and out share one dtype (fp32 or bf16); A_log and
        dt_bias one (fp32 or bf16). cache_indices: B int32 slot ids (-1 =
        padding: skipped, its output row untouched; 0 = the sentinel).

        With A_log and dt_bias, `a` and `b` are the raw gate inputs and the
        kernel forms g = -exp(A_log) * softplus(a + dt_bias) and beta =
        sigmoid(b) (SGLang's fused gating). Without them `a` is the
        log-space gate g and `b` is beta itself. beta_sigmoid overrides
        whether sigmoid is applied to b. l2norm: l2-normalise q and k in the
        kernel (SGLang's use_qk_l2norm_in_kernel; default True). scale: the
        query scale (None = K^-1/2).

        out: None allocates it (numpy, or like v for torch). stream: a
        cudaStream_t; None = torch.cuda.current_stream() of the pool's
        device when torch is loaded, else the pool's stream. Ignored by the
        host backend, which computes before returning.

        Raises StepqArgumentError (a ValueError) naming the argument for a
        wrong dtype, shape, contiguity or device before calling the library,
        and StepqError for what the library refuses (bad slot ids:
        STEPQ_EINVAL); nothing is written on failure.
        """
        layer = self._layer(layer)
        H, HV, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if (A_log is None) != (dt_bias is None):
            raise bad_arg("A_log, dt_bias: give both (gating in the kernel) or neither")
        gate = A_log is not None
        if beta_sigmoid is None:
            beta_sigmoid = gate
        if cache_indices is None:
            raise bad_arg("cache_indices: required")
        ids = self._slot_ids(cache_indices)
        B = ids.shape[0]
        if B > 65535:
            raise bad_arg("cache_indices: %d requests, more than 65535" % B, "STEPQ_ERANGE")
        dtypes = ("fp32", "bf16")
        views = {n: T.view(x, n, self.device, dtypes)
                 for n, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b))}
        dt = views["q"].dtype
        if out is None:
            out = self._new_like(v, (B, HV, V), dt)
        views["out"] = T.view(out, "out", self.device, dtypes)
        for n, x in views.items():
            if x.dtype != dt:
                raise bad_arg("%s: dtype %s, but q is %s (one dtype for q, k, v, a, b, out)"
                              % (n, x.dtype, dt))
        g_inner = (HV, K) if self.arch == "kda" else (HV,)
        strides = {
            "q": T.per_request(views["q"], B, (H, K), "H x K"),
            "k": T.per_request(views["k"], B, (H, K), "H x K"),
            "v": T.per_request(views["v"], B, (HV, V), "HV x V"),
            "a": T.per_request(views["a"], B, g_inner, "the gate: " + " x ".join(
                ("HV", "K")[:len(g_inner)])),
            "b": T.per_request(views["b"], B, (HV,), "HV"),
            "out": T.per_request(views["out"], B, (HV, V), "HV x V"),
        }
        args = _lib.StepArgs.new(
            batch=B, slot_ids=ids.ptr, dtype=_lib.DTYPES[dt],
            q=views["q"].ptr, k=views["k"].ptr, v=views["v"].ptr, g=views["a"].ptr,
            beta=views["b"].ptr, o=views["out"].ptr,
            q_stride=strides["q"], k_stride=strides["k"], v_stride=strides["v"],
            g_stride=strides["a"], beta_stride=strides["b"], o_stride=strides["out"],
            flags=(_lib.STEP_L2NORM if l2norm else 0)
            | (_lib.STEP_GATE_IN_KERNEL if gate else 0)
            | (_lib.STEP_BETA_SIGMOID if beta_sigmoid else 0),
            scale=0.0 if scale is None else float(scale),
            num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V)
        if gate:
            pa = T.view(A_log, "A_log", self.device, dtypes)
            pd = T.view(dt_bias, "dt_bias", self.device, dtypes)
            if pd.dtype != pa.dtype:
                raise bad_arg("dt_bias: dtype %s, but A_log is %s" % (pd.dtype, pa.dtype))
            T.exact(pa, (HV,), "HV")
            T.exact(pd, g_inner, " x ".join(("HV", "K")[:len(g_inner)]))
            args.A_log, args.dt_bias = pa.ptr, pd.ptr
            args.param_dtype = _lib.DTYPES[pa.dtype]
        check(lib.stepq_pool_decode_step(self.handle, layer, ctypes.byref(args),
                                         self._stream(stream)))
        return out

    def supports(self, op="decode", layer=-1, *, dtype="fp32", param_dtype="fp32", layout="kv",
                 gate_in_kernel=True, beta_sigmoid=None, l2norm=True, batch=1):
        """Whether the pool's backend runs `op` ("decode", "pack", "unpack")
        on `layer` (-1: every layer) with these dtypes, layout, flags and
        batch (stepq_pool_supports): (True, "") or (False, the reason, e.g.
        "cuda backend: head 64x64; ..."). A server asks once at load time.
        Arguments that are wrong on every backend raise StepqError."""
        ops = {"decode": _lib.OP_DECODE_STEP, "pack": _lib.OP_PREFILL_PACK,
               "unpack": _lib.OP_PREFILL_UNPACK}
        if op not in ops:
            raise bad_arg("op: %r is not one of %s" % (op, ", ".join(ops)))
        for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
            if value not in _lib.DTYPES:
                raise bad_arg("%s: %r is not one of %s" % (name, value, ", ".join(_lib.DTYPES)))
        if op == "decode":
            if beta_sigmoid is None:
                beta_sigmoid = gate_in_kernel
            args = _lib.StepArgs.new(
                batch=batch, dtype=_lib.DTYPES[dtype], param_dtype=_lib.DTYPES[param_dtype],
                flags=(_lib.STEP_L2NORM if l2norm else 0)
                | (_lib.STEP_GATE_IN_KERNEL if gate_in_kernel else 0)
                | (_lib.STEP_BETA_SIGMOID if beta_sigmoid else 0))
        else:
            if layout not in _LAYOUTS:
                raise bad_arg("layout: %r is not \"kv\" or \"vk\"" % (layout,))
            args = _lib.PrefillArgs.new(n=batch, dtype=_lib.DTYPES[dtype], layout=_LAYOUTS[layout])
        st = lib.stepq_pool_supports(self.handle, ops[op], layer, ctypes.byref(args))
        if st == _lib.STATUS["STEPQ_ENOTSUP"]:
            return False, _lib.last_error()
        check(st)
        return True, ""

    def _new_like(self, like, shape, dt):
        if self.device == "cpu" and hasattr(like, "__array_interface__"):
            np = _numpy()
            if dt != "fp32":
                raise bad_arg("out: numpy has no %s; pass out" % dt)
            return np.zeros(shape, dtype=np.float32)
        return like.new_zeros(shape)  # a torch tensor: same dtype and device

    def _states(self, states, n, layout, name="states"):
        if layout not in _LAYOUTS:
            raise bad_arg("layout: %r is not \"kv\" ([K][V] heads) or \"vk\" ([V][K])" % (layout,))
        HV, K, V = self.num_v_heads, self.head_k_dim, self.head_v_dim
        inner = (HV, K, V) if layout == "kv" else (HV, V, K)
        s = T.view(states, name, self.device, ("fp32", "bf16"))
        stride = T.per_request(s, n, inner, "HV x %s" % ("K x V" if layout == "kv" else "V x K"))
        return s, stride

    def _prefill(self, fn, layer, ids, states, layout, stream):
        layer = self._layer(layer)
        iv = self._slot_ids(ids)
        n = iv.shape[0]
        if n > 65535:
            raise bad_arg("cache_indices: %d entries, more than 65535" % n, "STEPQ_ERANGE")
        s, stride = self._states(states, n, layout)
        args = _lib.PrefillArgs.new(
            n=n, slot_ids=iv.ptr, states=s.ptr, state_stride=stride, dtype=_lib.DTYPES[s.dtype],
            layout=_LAYOUTS[layout], num_v_heads=self.num_v_heads, head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim)
        check(fn(self.handle, layer, ctypes.byref(args), self._stream(stream)))

    def new_states(self, n, layout="kv", dtype=None):
        """A zeroed dense state buffer for n entries of one layer: [n, HV, K, V]
        ("kv") or [n, HV, V, K] ("vk"). Host backend: a numpy float32 array
        (dtype None), or a CPU torch tensor of a torch dtype. CUDA backend: a
        torch tensor on the pool's device (dtype default torch.float32)."""
        if layout not in _LAYOUTS:
            raise bad_arg("layout: %r is not \"kv\" ([K][V] heads) or \"vk\" ([V][K])" % (layout,))
        HV, K, V = self.num_v_heads, self.head_k_dim, self.head_v_dim
        shape = (n, HV, K, V) if layout == "kv" else (n, HV, V, K)
        if self.device == "cpu" and dtype is None:
            np = _numpy()
            return np.zeros(shape, dtype=np.float32)
        torch = _torch()
        if torch is None:
            raise bad_arg("dtype: a %s state buffer needs torch (import it first)"
                          % (dtype or "CUDA",))
        dev = "cpu" if self.device == "cpu" else "cuda:%d" % self.device[1]
        return torch.zeros(shape, dtype=dtype or torch.float32, device=dev)

    def unpack(self, layer, cache_indices, states=None, layout="kv", stream=None):
        """Reconstructs the slots' states of one layer into dense `states`
        (stepq_pool_prefill_unpack; -1 entries left as they are; slots may
        repeat). states None: new_states(). Returns states."""
        if states is None:
            states = self.new_states(len(cache_indices), layout)
        self._prefill(lib.stepq_pool_prefill_unpack, layer, cache_indices, states, layout, stream)
        return states

    def pack(self, layer, cache_indices, states, layout="kv", stream=None):
        """Packs dense `states` into the slots' pages of one layer
        (stepq_pool_prefill_pack: fit, quantize, write; -1 entries skipped,
        slots allocated and distinct, sentinel 0 allowed)."""
        self._prefill(lib.stepq_pool_prefill_pack, layer, cache_indices, states, layout, stream)

    def extend(self, layer, cache_indices, chunk_fn, *, has_initial_state=None, states=None,
               layout="kv", stream=None):
        """Runs the server's prefill chunk kernel on packed slots: unpacks the
        slots' states of `layer` into a dense buffer, calls
        ``chunk_fn(states)``, packs the final states back, and returns what
        chunk_fn returned.

        chunk_fn receives the dense initial states [n, HV, K, V] ("kv", fla's
        layout) or [n, HV, V, K] ("vk", SGLang's) and returns the final
        states: the same buffer updated in place, a new tensor of the same
        shape and dtype, or a tuple whose last element is the final states
        (as the fla chunk kernels return (o, final_state)).

        has_initial_state: per entry, whether the slot holds a prefix to
        continue (a bool sequence, numpy or torch mask); entries without one
        start from zeros instead of the slot's page. states: the buffer to
        use (default new_states(n, layout)); entries without an initial
        state are then left as the caller filled them. -1 ids are skipped
        by both unpack and pack.
        """
        n = len(cache_indices)
        if states is None:
            states = self.new_states(n, layout)
        unpack_ids = cache_indices
        if has_initial_state is not None:
            unpack_ids = self._mask_ids(cache_indices, has_initial_state, n)
        self.unpack(layer, unpack_ids, states, layout, stream)
        result = chunk_fn(states)
        final = result[-1] if isinstance(result, tuple) else result
        if final is None:
            raise bad_arg("chunk_fn: returned no final states (return the buffer it updated)")
        self.pack(layer, cache_indices, final, layout, stream)
        return result

    def _mask_ids(self, ids, mask, n):
        """cache_indices with -1 where has_initial_state is false."""
        if hasattr(ids, "data_ptr"):  # a torch tensor, on any device: stay there
            torch = _torch()
            m = torch.as_tensor(mask, dtype=torch.bool, device=ids.device)
            if tuple(m.shape) != (n,):
                raise bad_arg("has_initial_state: shape %s, expected [%d]" % (list(m.shape), n),
                              "STEPQ_ESHAPE")
            return ids.masked_fill(~m, -1)
        np = _numpy()
        m = np.asarray(mask.tolist() if hasattr(mask, "tolist") else mask, dtype=bool)
        if m.shape != (n,):
            raise bad_arg("has_initial_state: shape %s, expected [%d]" % (list(m.shape), n),
                          "STEPQ_ESHAPE")
        arr, _ = _host_ids(ids, "cache_indices")
        return np.where(m, np.frombuffer(arr, dtype=np.int32), -1).astype(np.int32)
