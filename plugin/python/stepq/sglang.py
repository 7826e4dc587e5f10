"""stepq inside SGLang: a general plugin (entry point group
``sglang.srt.plugins``, declared in plugin/python/pyproject.toml) that puts a
stepq StatePool in place of SGLang's dense MambaPool for Gated DeltaNet and
Kimi Delta Attention models, and routes the linear-attention kernels' state
through it.

Activation: SGLang loads every installed plugin and calls ``register()`` in
each of its processes. The plugin does nothing unless ``STEPQ_MAP`` names a
precision map (``stepq.load_map``) for the served checkpoint; SGLang has no
way for a plugin to add a server argument that reaches its scheduler
processes, an environment variable does. The map is loaded and checked
against SGLang's ``cache_params`` when the pool is built (start-up), not in
``register()``: SGLang logs and skips a plugin whose ``register()`` raises,
so a bad map there would leave the dense pool in place without failing.

What it hooks (SGLang's HookRegistry; paths as of SGLang 8905cbd, see
plugin/python/SGLANG.md for every code path and how it is handled):

* ``HybridReqToTokenPool._init_mamba_pool`` (AROUND): refuses what stepq
  cannot serve, builds the pool through the instance's ``mamba_pool_cls``
  set to ``StepqMambaPool`` (MambaPool's interface over a StatePool), and
  replaces ``mamba_allocator`` by ``StepqSlotAllocator`` (stepq's slot ids:
  its clear, copy and steps refuse slots it did not hand out). The class
  attribute ``HybridReqToTokenPool.mamba_pool_cls`` is left alone: a REPLACE
  hook on it would make the registry rebind the name ``MambaPool`` in every
  loaded module (``_propagate_patch``), including the dense pool's own
  module and its subclasses' users.
* ``HybridReqToTokenPool.__init__`` (BEFORE): refuses subclasses that build
  their own pool (``UnifiedHybridReqToTokenPool``, --enable-unified-memory).
* ``KVCacheConfigurator._handle_max_mamba_cache`` (AROUND): SGLang sizes the
  state pool (``max_mamba_cache_size``) and what it leaves to the KV cache
  from ``mamba_cache_per_req``, the dense slot's bytes. The hook runs it with
  that number replaced by stepq's slot (``slot_bytes``: the page of this
  rank, from ``stepq_pool_plan``, plus its health word), so the memory a
  compressed state saves becomes slots (auto-sizing) or KV cache (a given
  --max-mamba-cache-size). Not with speculative decoding, which the pool
  refuses anyway.
* Registered when the first stepq pool is built (so plugin loading in the
  engine's main process imports only ``mem_cache.memory_pool`` and, for the
  sizing hook, ``mem_cache.kv_cache_configurator``, which must be in place
  before the scheduler sizes its pools; SGLang starts its schedulers with
  the spawn method, so these imports in the main process touch no device):
  ``MambaAttnBackendBase.__init__`` (AFTER: only GDNAttnBackend and
  KDAAttnBackend are served), ``GDNAttnBackend.__init__`` and
  ``KDAAttnBackend.__init__`` (AFTER: the kernel dispatcher's decode,
  extend and verify kernels become ``StepqLinearAttnKernel``),
  ``MambaPoolHost.__init__`` (BEFORE: refuses HiCache), and with PD
  disaggregation the transfer backend's TP-slicing state transfer (refused).

The dense ``mamba_cache.temporal`` does not exist in a stepq pool. What
SGLang's code receives in its place is ``PackedStates``: shape, dtype and
device of the dense tensor, the pool and the layer, and a StepqError
(STEPQ_ENOTSUP) naming the operation for any data access (indexing, a torch
function, ``data_ptr()``). The conv states are real tensors: strided views of
the conv bytes inside the packed pages (stepq never quantizes them).

Importing this module needs neither torch nor SGLang; ``register()`` and the
classes (``StepqMambaPool``, ``StepqSlotAllocator``,
``StepqLinearAttnKernel``) import them when used and raise ImportError
naming what is missing. ``import stepq`` does not import this module.
"""

import inspect
import logging
import os
import threading

from .errors import StepqError

__all__ = ["register", "Unsupported", "PackedStates", "MAP_ENV", "ENTRY_POINT",
           "pool_refusals", "server_refusals", "check_map", "map_desc", "cache_desc", "slot_bytes"]

logger = logging.getLogger("stepq.sglang")

#: The environment variable naming the precision map; unset = plugin inert.
MAP_ENV = "STEPQ_MAP"
#: The entry point value declared in pyproject.toml (group sglang.srt.plugins).
ENTRY_POINT = "stepq.sglang:register"

_MP = "sglang.srt.mem_cache.memory_pool"
T_REQ_POOL_INIT = _MP + ".HybridReqToTokenPool.__init__"
T_INIT_MAMBA_POOL = _MP + ".HybridReqToTokenPool._init_mamba_pool"
T_BACKEND_BASE_INIT = ("sglang.srt.layers.attention.hybrid_linear_attn_backend"
                       ".MambaAttnBackendBase.__init__")
T_GDN_INIT = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.__init__"
T_KDA_INIT = "sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend.__init__"
T_HOST_POOL_INIT = "sglang.srt.mem_cache.memory_pool_host.MambaPoolHost.__init__"
T_MAMBA_SIZING = ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
                  "._handle_max_mamba_cache")
#: Bytes a stepq slot costs besides its page: its health word (backend memory).
HEALTH_WORD_BYTES = 4
T_PD = {
    "mooncake": "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_mamba_state_slice",
    "nixl": "sglang.srt.disaggregation.nixl.conn.NixlKVManager._send_mamba_state_slice",
    "mori": "sglang.srt.disaggregation.mori.conn.MoriKVManager._send_mamba_state",
}
# The backends served, by (module, class) exactly: subclasses may override
# the forward paths that this plugin relies on.
_SERVED_BACKENDS = {
    ("sglang.srt.layers.attention.linear.gdn_backend", "GDNAttnBackend"): "gdn",
    ("sglang.srt.layers.attention.linear.kda_backend", "KDAAttnBackend"): "kda",
}

_lock = threading.RLock()
_registered = False
_runtime_hooks_done = False
_registry = None          # (HookRegistry, HookType) that register() used
hook_status = {}          # target -> "applied" | "not applied" | "registered"


class Unsupported(StepqError):
    """An SGLang feature or code path that a stepq pool does not serve,
    refused at start-up (or, for a path only reachable at run time, where it
    is reached). ``feature`` names it (a flag, a class, a code path)."""

    def __init__(self, feature, why, hint=None):
        self.feature = feature
        msg = "stepq (%s) does not serve %s: %s" % (MAP_ENV, feature, why)
        if hint:
            msg += ". " + hint
        msg += " (plugin/python/SGLANG.md lists every path)"
        super().__init__("STEPQ_ENOTSUP", msg)


# --- refusals and checks on plain values (no torch, no SGLang) -------------

def pool_refusals(*, device, enable_memory_saver=False, speculative_num_draft_tokens=None,
                  enable_linear_replayssm=False, enable_gdn_replayssm_spec=False,
                  envelope_layout=False, custom_mem_pool=None):
    """Raises Unsupported for a MambaPool configuration stepq cannot serve
    (the arguments SGLang's HybridReqToTokenPool passes to its pool class)."""
    if speculative_num_draft_tokens is not None:
        raise Unsupported(
            "speculative decoding (speculative_num_draft_tokens=%r; --speculative-algorithm)"
            % (speculative_num_draft_tokens,),
            "its verify step writes each draft token's state into MambaPool's "
            "intermediate_ssm / intermediate_conv_window and scatters the accepted one into "
            "the dense temporal tensor (hybrid_linear_attn_backend.py: "
            "update_mamba_state_after_mtp_verify); stepq has no multi-token verify")
    if enable_linear_replayssm or enable_gdn_replayssm_spec:
        raise Unsupported(
            "ReplaySSM (--enable-linear-replayssm / --enable-gdn-replayssm-spec)",
            "its ring buffers fold into the dense temporal tensor inside SGLang's Triton "
            "decode and verify kernels")
    if envelope_layout:
        raise Unsupported(
            "the page-major envelope layout (--enable-page-major-kv-layout)",
            "it lays conv and temporal out as views of one dense byte buffer "
            "(mem_cache/layout/page_major.py)")
    if enable_memory_saver:
        raise Unsupported(
            "--enable-memory-saver",
            "stepq's pages are allocated by libstepq, outside torch_memory_saver's regions, "
            "so releasing and resuming memory occupation would not cover them")
    if custom_mem_pool:
        raise Unsupported(
            "SGLANG_MOONCAKE_CUSTOM_MEM_POOL=%s" % custom_mem_pool,
            "the NVLink custom memory pool (mem_cache/utils.py: maybe_init_custom_mem_pool) "
            "allocates the pool's tensors under torch.cuda.use_mem_pool; stepq allocates its own")
    dev = str(device) if device is not None else "cuda"
    if not (dev == "cuda" or dev.startswith("cuda:")):
        raise Unsupported(
            "device %r" % dev,
            "stepq's SGLang pool runs on the CUDA backend only (SGLang's CPU, NPU and XPU "
            "paths use their own layouts and kernels on the dense tensors)")


def server_refusals(sa):
    """Raises Unsupported for server arguments stepq cannot serve; returns a
    list of warnings (strings) for the ones it ignores. `sa` is SGLang's
    ServerArgs or any object with those attributes (missing = default)."""
    g = lambda name, default=None: getattr(sa, name, default)  # noqa: E731
    if g("enable_int8_mamba_checkpoint", False):
        raise Unsupported(
            "--enable-int8-mamba-checkpoint",
            "its store (mem_cache/mamba_checkpoint_pool.py: MambaCheckpointPool.store_from_active "
            "/ load_to_active) quantizes mamba_cache.temporal[:, slots] and copies the dense "
            "conv tensors by slot",
            "stepq's pages are already packed; run without the flag")
    if g("enable_hierarchical_cache", False):
        raise Unsupported(
            "--enable-hierarchical-cache (HiMambaRadixCache, MambaPoolHost)",
            "mem_cache/memory_pool_host.py: MambaPoolHost reads each layer's "
            "mamba_cache.temporal[l].data_ptr() and copies temporal[l] / conv[c][l] per layer")
    if g("enable_unified_memory", False):
        raise Unsupported(
            "--enable-unified-memory (UnifiedHybridReqToTokenPool, UnifiedMambaPool)",
            "its mamba pool is a set of dense views over one shared byte buffer")
    if g("speculative_algorithm") is not None:
        raise Unsupported(
            "speculative decoding (--speculative-algorithm %s)" % g("speculative_algorithm"),
            "its verify step writes per-draft-token states into intermediate_ssm and scatters "
            "them into the dense temporal tensor; stepq has no multi-token verify")
    if (not g("disable_radix_cache", False)
            and g("mamba_radix_cache_strategy") in ("extra_buffer", "extra_buffer_lazy")):
        raise Unsupported(
            "--mamba-radix-cache-strategy %s" % g("mamba_radix_cache_strategy"),
            "the extra-buffer strategy copies each layer's conv and temporal rows into the "
            "track slots inside the decode CUDA graph (mamba_state_scatter_triton.py: "
            "track_mamba_states_if_needed), a device-side masked copy stepq does not have",
            "Use --mamba-radix-cache-strategy no_buffer (SGLang then disables overlap "
            "scheduling) or --disable-radix-cache; 'auto' picks extra_buffer whenever overlap "
            "scheduling is on")
    if g("enable_linear_replayssm", False) or g("enable_gdn_replayssm_spec", False):
        raise Unsupported("ReplaySSM (--enable-linear-replayssm / --enable-gdn-replayssm-spec)",
                          "its rings fold into the dense temporal tensor")
    if g("enable_page_major_kv_layout", False):
        raise Unsupported("--enable-page-major-kv-layout",
                          "the mamba envelope layout is a dense byte buffer of conv and temporal")
    if g("enable_memory_saver", False):
        raise Unsupported("--enable-memory-saver",
                          "stepq's pages are outside torch_memory_saver's regions")
    if (g("pp_size", 1) or 1) > 1:
        raise Unsupported(
            "pipeline parallelism (--pp-size %d)" % g("pp_size"),
            "each stage's pool holds its own layers, a stepq map and pool hold all of them")
    dev = g("device")
    if dev not in (None, "cuda") and not str(dev).startswith("cuda:"):
        raise Unsupported("--device %s" % dev, "stepq's SGLang pool runs on CUDA only")
    warnings = []
    for name in ("linear_attn_backend", "linear_attn_decode_backend"):
        value = g(name)
        if value not in (None, "triton"):
            warnings.append(
                "--%s %s: decode runs stepq's kernel (stepq_pool_decode_step) whatever the "
                "backend" % (name.replace("_", "-"), value))
    if g("enable_torch_compile", False):
        warnings.append("--enable-torch-compile: stepq's kernel calls are excluded from "
                        "compilation (torch.compiler.disable); not verified with SGLang")
    if g("disaggregation_mode", "null") not in (None, "null"):
        warnings.append(
            "--disaggregation-mode %s: the state transfer moves stepq's pages and health "
            "words as they are; both ends must run the same %s map and attention-TP size (a "
            "TP-slicing transfer is refused when it happens; nothing compares the maps)"
            % (g("disaggregation_mode"), MAP_ENV))
    return warnings


def map_desc(m):
    """The fields of a stepq.Map that check_map compares, as a dict."""
    return {"arch": m.arch, "layer_ids": tuple(m.layer_ids), "num_k_heads": m.num_k_heads,
            "num_v_heads": m.num_v_heads, "head_k_dim": m.head_k_dim,
            "head_v_dim": m.head_v_dim, "conv_shape": tuple(m.conv_shape),
            "conv_dtype": m.conv_dtype, "path": getattr(m, "path", None)}


_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def cache_desc(cache_params, mamba_layer_ids):
    """What check_map compares, from SGLang's cache parameters
    (Mamba2CacheParams / KimiLinearCacheParams) and the pool's layer ids."""
    shape = cache_params.shape
    dt = cache_params.dtype
    return {"is_kda": bool(getattr(cache_params, "is_kda", False)),
            "layer_ids": list(mamba_layer_ids), "temporal": tuple(shape.temporal),
            "conv": [tuple(s) for s in shape.conv],
            "conv_dtype": _DTYPE_NAMES.get(str(dt.conv), str(dt.conv)),
            "temporal_dtype": _DTYPE_NAMES.get(str(dt.temporal), str(dt.temporal)),
            "num_k_heads_per_tp": getattr(shape, "num_k_heads_per_tp", None)}


def _prod(xs):
    n = 1
    for x in xs:
        n *= int(x)
    return n


def check_map(m, c):
    """Checks a map (map_desc) against SGLang's cache description and returns
    the attention-TP size the shapes imply. `c`: is_kda (bool), layer_ids,
    temporal (HV, V, K of this rank), conv (list of this rank's conv shapes),
    conv_dtype and temporal_dtype (stepq names: "bf16", "fp32", "fp16", or
    another name), num_k_heads_per_tp (or None). Raises Unsupported naming
    the first mismatch."""
    where = "the map %s" % (m.get("path") or "(buffer)")
    arch = "kda" if c["is_kda"] else "gdn"
    if m["arch"] != arch:
        raise Unsupported(
            "this checkpoint with %s" % where,
            "the map's arch is %s but SGLang's cache parameters are %s (%s)"
            % (m["arch"], arch, "KimiLinearCacheParams" if c["is_kda"] else "Mamba2CacheParams"))
    if tuple(c["layer_ids"]) != tuple(m["layer_ids"]):
        raise Unsupported(
            "this layer set with %s" % where,
            "SGLang's pool holds recurrent layers %s, the map %s (a pipeline stage holds "
            "only its own layers; the map must list exactly the pool's layers)"
            % (list(c["layer_ids"]), list(m["layer_ids"])))
    hv, v, k = (int(x) for x in c["temporal"])
    if hv <= 0 or m["num_v_heads"] % hv:
        raise Unsupported(
            "this head count with %s" % where,
            "SGLang's temporal state has %d value heads per rank, which does not divide the "
            "map's %d" % (hv, m["num_v_heads"]))
    tp = m["num_v_heads"] // hv
    if (v, k) != (m["head_v_dim"], m["head_k_dim"]):
        raise Unsupported(
            "this head shape with %s" % where,
            "SGLang's temporal state is [HV=%d, V=%d, K=%d], the map's heads are V=%d x K=%d"
            % (hv, v, k, m["head_v_dim"], m["head_k_dim"]))
    if m["num_k_heads"] % tp:
        raise Unsupported("this TP size with %s" % where,
                          "%d q/k heads do not split over %d ranks" % (m["num_k_heads"], tp))
    hk = c.get("num_k_heads_per_tp")
    if hk is not None and int(hk) != m["num_k_heads"] // tp:
        raise Unsupported(
            "this q/k head count with %s" % where,
            "SGLang has %d q/k heads per rank, the map %d / %d = %d"
            % (int(hk), m["num_k_heads"], tp, m["num_k_heads"] // tp))
    convs = list(c["conv"])
    if len(convs) != 1:
        raise Unsupported("%d conv state tensors" % len(convs),
                          "stepq keeps one conv state per layer (GDN and KDA have one)")
    local = _prod(convs[0])
    full = _prod(m["conv_shape"]) if m["conv_shape"] else 0
    if full == 0 or full % tp or full // tp != local:
        raise Unsupported(
            "this conv state with %s" % where,
            "SGLang's conv state is %s per rank (%d values), the map's %s over %d ranks (%s)"
            % (list(convs[0]), local, list(m["conv_shape"]), tp,
               "%d values each" % (full // tp) if full and not full % tp else "no even split"))
    if c["conv_dtype"] != m["conv_dtype"]:
        raise Unsupported("conv dtype %s with %s" % (c["conv_dtype"], where),
                          "the map stores the conv state as %s" % m["conv_dtype"])
    if c["temporal_dtype"] not in ("fp32", "bf16"):
        raise Unsupported(
            "--mamba-ssm-dtype %s" % c["temporal_dtype"],
            "the dense states stepq unpacks for the prefill chunk kernel and packs back are "
            "fp32 or bf16")
    return tp


# --- the stand-in for the dense temporal tensor (no torch needed) -----------

def _is_index_tensor(x):
    try:
        return str(x.dtype) in ("torch.int32", "torch.int64") and x.dim() == 1
    except Exception:
        return False


def _describe(idx):
    if isinstance(idx, tuple):
        return ", ".join(_describe(i) for i in idx)
    if isinstance(idx, slice):
        return ":" if idx == slice(None) else "%s:%s" % (idx.start, idx.stop)
    if hasattr(idx, "shape") and hasattr(idx, "dtype"):
        return "<%s %s>" % (str(idx.dtype).replace("torch.", ""), list(idx.shape))
    return repr(idx)


class _NoData:
    """What a stand-in for a dense tensor answers to any data access: the
    subclass's refuse() raises Unsupported naming the access."""

    __slots__ = ()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.refuse(".%s" % name)

    def data_ptr(self):
        self.refuse("data_ptr()")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, _NoData):
                a.refuse("torch function %s" % getattr(func, "__name__", func))
        raise TypeError("%s.__torch_function__ without a stepq stand-in argument" % cls.__name__)


class PackedStates(_NoData):
    """What a stepq pool has where SGLang's MambaPool has ``mamba_cache.temporal``
    (layer None: ``[L, size + 1, HV, V, K]``) or one layer of it
    (``[size + 1, HV, V, K]``): the dense tensor's shape, dtype and device
    for the code that only reads those, the pool and the layer for stepq's
    kernel backend, and an Unsupported error naming the operation for
    anything that would read or write dense state."""

    __slots__ = ("owner", "layer", "shape", "dtype", "device")

    def __init__(self, owner, layer, shape, dtype, device):
        self.owner, self.layer = owner, layer
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    # metadata that SGLang reads without touching data
    @property
    def ndim(self):
        return len(self.shape)

    def dim(self):
        return len(self.shape)

    def size(self, d=None):
        return self.shape if d is None else self.shape[d]

    def is_contiguous(self, *args, **kwargs):
        return False  # not a dense tensor: SGLang's gather paths take it through __getitem__

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return "<stepq.sglang.PackedStates %s%s %s (no dense tensor)>" % (
            "all layers" if self.layer is None else "layer %d" % self.layer,
            list(self.shape), self.dtype)

    def _where(self):
        return "mamba_cache.temporal" + ("" if self.layer is None else "[%d]" % self.layer)

    def refuse(self, what):
        status = ", ".join("%s: %s" % (t.rsplit(".", 2)[-2], s) for t, s in sorted(hook_status.items()))
        raise Unsupported(
            "%s on %s" % (what, self._where()),
            "a stepq pool has no dense temporal tensor; the recurrent states are packed "
            "pages, reached only through the pool's clear_slots / copy_from / get_cpu_copy / "
            "load_cpu_copy and the stepq kernel backend",
            "If a dense kernel got here, the stepq backend hooks were not in place (%s)"
            % (status or "none registered"))

    def __getitem__(self, idx):
        if self.layer is None and isinstance(idx, int) and not isinstance(idx, bool):
            if not -self.shape[0] <= idx < self.shape[0]:
                raise IndexError("layer %d of %d" % (idx, self.shape[0]))
            return PackedStates(self.owner, idx % self.shape[0], self.shape[1:], self.dtype,
                                self.device)
        if self.layer is not None and _is_index_tensor(idx):
            return _Gathered(self, idx)
        self.refuse("reading [%s]" % _describe(idx))

    def __setitem__(self, idx, value):
        if (self.layer is not None and isinstance(value, _Gathered) and value.parent is self
                and value.ids is idx):
            if not value.packed:
                self.refuse("scattering back a gather that no stepq kernel packed")
            return  # the stepq kernel packed the slots already (gdn_backend's gather path)
        self.refuse("writing [%s] = %s" % (_describe(idx), type(value).__name__))

    def __iter__(self):
        self.refuse("iterating")

    def __bool__(self):
        return True

    def numel(self):
        self.refuse("numel()")

    def element_size(self):
        self.refuse("element_size()")

    def stride(self, *args):
        self.refuse("stride()")


class _Gathered(_NoData):
    """``layer_states[ids]`` as SGLang's GDN prefill takes it (the
    needs_state_gather path): no data, only the slots, handed to the stepq
    kernel in place of the gathered dense states; the kernel packs the
    final states and marks it, and the scatter back is then a no-op."""

    __slots__ = ("parent", "ids", "packed")

    def __init__(self, parent, ids):
        self.parent, self.ids, self.packed = parent, ids, False

    def contiguous(self, *args, **kwargs):
        return self

    def is_contiguous(self, *args, **kwargs):
        return True

    @property
    def shape(self):
        return (int(self.ids.shape[0]),) + tuple(self.parent.shape[1:])

    @property
    def dtype(self):
        return self.parent.dtype

    @property
    def device(self):
        return self.parent.device

    def refuse(self, what):
        self.parent.refuse("%s (a gather by slot)" % what)

    def __getitem__(self, idx):
        self.refuse("reading [%s]" % _describe(idx))

    def __setitem__(self, idx, value):
        self.refuse("writing [%s]" % _describe(idx))


# --- registration ----------------------------------------------------------

def _sglang_registry():
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as e:
        raise ImportError(
            "stepq.sglang needs SGLang's plugin framework (sglang.srt.plugins.hook_registry), "
            "which cannot be imported here: %s" % e) from e
    return HookRegistry, HookType


def register(registry=None, hook_type=None):
    """SGLang's plugin entry point (``stepq.sglang:register``): registers the
    hooks when STEPQ_MAP is set, else does nothing. Returns the registered
    targets. `registry` / `hook_type`: a HookRegistry-like class and its
    HookType enum (tests); default SGLang's."""
    global _registered, _registry
    path = os.environ.get(MAP_ENV)
    if not path:
        logger.info("stepq: %s is not set; the SGLang plugin stays inactive", MAP_ENV)
        return []
    with _lock:
        if _registered:
            return []
        if registry is None:
            registry, default_type = _sglang_registry()
            hook_type = hook_type or default_type
        if hook_type is None:
            raise TypeError("register(registry=...): hook_type (the HookType enum) is needed too")
        hooks = [(T_REQ_POOL_INIT, _req_pool_init_before, hook_type.BEFORE),
                 (T_INIT_MAMBA_POOL, _init_mamba_pool_around, hook_type.AROUND),
                 (T_MAMBA_SIZING, _mamba_sizing_around, hook_type.AROUND)]
        for target, hook, kind in hooks:
            registry.register(target, hook, kind)
            hook_status[target] = "registered"
        _registry = (registry, hook_type)
        _registered = True
    logger.info("stepq: hooks registered for %s=%s (stepq is in use only once the log says "
                "'stepq: state pool'; an SGLang line 'Failed to apply hooks to %s' means it "
                "is not)", MAP_ENV, path, T_INIT_MAMBA_POOL)
    return [t for t, _, _ in hooks]


def _runtime_hooks(server_args):
    """The hooks registered when the first stepq pool is built, as
    (target, hook, HookType member name)."""
    hooks = [(T_BACKEND_BASE_INIT, _backend_base_init_after, "AFTER"),
             (T_GDN_INIT, _gdn_init_after, "AFTER"),
             (T_KDA_INIT, _kda_init_after, "AFTER"),
             (T_HOST_POOL_INIT, _host_pool_init_before, "BEFORE")]
    mode = getattr(server_args, "disaggregation_mode", "null") if server_args is not None else "null"
    if mode not in (None, "null"):
        backend = getattr(server_args, "disaggregation_transfer_backend", None)
        target = T_PD.get(backend)
        if target is not None:
            hooks.append((target, _mori_send_around if backend == "mori" else _pd_slice_around,
                          "AROUND"))
    return hooks


def _register_runtime_hooks(server_args):
    global _runtime_hooks_done
    with _lock:
        if _runtime_hooks_done or _registry is None:
            return
        registry, hook_type = _registry
        targets = []
        for target, hook, kind in _runtime_hooks(server_args):
            registry.register(target, hook, getattr(hook_type, kind))
            hook_status[target] = "registered"
            targets.append(target)
        _runtime_hooks_done = True
        apply = getattr(registry, "apply_hooks", None)
        if apply is not None:
            apply()  # idempotent: targets already patched are skipped
        patched = getattr(registry, "_patched", None)
        for target in list(hook_status) if patched is not None else ():
            hook_status[target] = "applied" if target in patched else "not applied"
            if target not in patched and target in targets:
                logger.warning("stepq: the hook on %s was not applied (SGLang logged why); "
                               "what it guards goes unchecked, and a dense kernel or copy "
                               "that then meets PackedStates fails with STEPQ_ENOTSUP", target)


# --- the hooks -------------------------------------------------------------

def _server_args():
    """SGLang's process-wide ServerArgs, or None where none is set (unit tests)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, ValueError, AttributeError):
        return None


def _served_map(who, path=None):
    """(path, the loaded map) of the served checkpoint: `path`, default $STEPQ_MAP; a StepqError
    naming the variable when it is unset, or the variable and the path with the loader's message."""
    from .map import load_map

    path = path or os.environ.get(MAP_ENV)
    if not path:
        raise StepqError("STEPQ_EINVAL", "%s: %s (the precision map of the served checkpoint) is "
                         "not set" % (who, MAP_ENV))
    try:
        return path, load_map(path)
    except StepqError as e:
        raise StepqError(e.name, "%s=%s: %s" % (MAP_ENV, path, e.message), e.status) from e


def slot_bytes(cache_params, device="cuda", tp_rank=None, path=None, layer_ids=None):
    """The bytes one slot of the stepq pool that StepqMambaPool would build
    for these cache parameters costs on this rank: its page (stepq_pool_plan,
    the map at `path`, default $STEPQ_MAP) plus its health word. Returns
    (slot bytes, the map's tp size). The map is checked against the cache
    parameters first (check_map: Unsupported naming the mismatch), so a
    wrong map stops the server at sizing, before any memory is planned.
    tp_rank: this rank (default: SGLang's attention-TP rank when tp > 1).
    layer_ids: the recurrent layers the pool holds (default all of
    cache_params.layers; a pipeline stage holds its own only)."""
    from .pool import plan_pool

    path, smap = _served_map("stepq", path)
    with smap:
        layers = list(cache_params.layers) if layer_ids is None else list(layer_ids)
        tp_size = check_map(map_desc(smap), cache_desc(cache_params, layers))
        if tp_rank is None:
            tp_rank = 0
            if tp_size > 1:
                from sglang.srt.runtime_context import get_parallel

                tp_rank = get_parallel().attn_tp_rank
        dev = "cuda" if str(device).startswith("cuda") else "cpu"
        plan = plan_pool(smap, size=1, device=dev, tp_rank=tp_rank, tp_size=tp_size)
    return plan["page_bytes"] + HEALTH_WORD_BYTES, tp_size


class _SizedCacheParams:
    """SGLang's cache parameters with mamba_cache_per_req replaced (the rest delegated)."""

    def __init__(self, params, per_req):
        self._params = params
        self.mamba_cache_per_req = per_req

    def __getattr__(self, name):
        return getattr(self._params, name)


class _SizedConfig:
    """A mambaish config whose mamba2_cache_params are _SizedCacheParams (the rest delegated)."""

    def __init__(self, config, per_req):
        self._config = config
        self._per_req = per_req

    @property
    def mamba2_cache_params(self):
        return _SizedCacheParams(self._config.mamba2_cache_params, self._per_req)

    def __getattr__(self, name):
        return getattr(self._config, name)


def _mamba_sizing_around(original, self, *args, **kwargs):
    """KVCacheConfigurator._handle_max_mamba_cache AROUND hook: SGLang's own
    sizing with stepq's slot bytes in place of the dense slot's (module
    docstring); the configurator's mambaish_config is restored afterwards."""
    config = getattr(self, "mambaish_config", None)
    spec = getattr(self, "spec_algorithm", None)
    if config is None or (spec is not None and not spec.is_none()):
        return original(self, *args, **kwargs)  # no recurrent state / refused at the pool
    params = config.mamba2_cache_params
    dense = params.mamba_cache_per_req
    ps = getattr(self, "ps", None)
    li = getattr(self, "layer_info", None)
    layers = None
    if li is not None:  # this pipeline stage's layers, as SGLang hands them to the pool
        layers = [i for i in params.layers if li.start_layer <= i < li.end_layer]
    per_req, tp_size = slot_bytes(params, getattr(self, "device", "cuda"),
                                  tp_rank=getattr(ps, "attn_tp_rank", None), layer_ids=layers)
    self.mambaish_config = _SizedConfig(config, per_req)
    try:
        rest = original(self, *args, **kwargs)
    finally:
        self.mambaish_config = config
    sa = getattr(self, "server_args", None)
    n = getattr(sa, "max_mamba_cache_size", None)
    logger.info("stepq: state pool sized by stepq's slot, %d B (page + health word, tp %d) instead of "
                "the dense slot's %d B (%.2fx): max_mamba_cache_size = %s", per_req, tp_size, dense,
                dense / per_req if per_req else float("nan"), n)
    return rest


def _req_pool_init_before(self, *args, **kwargs):
    """HybridReqToTokenPool.__init__ BEFORE hook: a subclass with its own
    _init_mamba_pool would build a pool this plugin never sees."""
    cls = type(self)
    base = next((c for c in cls.__mro__ if c.__name__ == "HybridReqToTokenPool"
                 and c.__module__ == _MP), None)
    if base is not None and cls is not base and cls._init_mamba_pool is not base._init_mamba_pool:
        hint = ("--enable-unified-memory builds it" if cls.__name__ == "UnifiedHybridReqToTokenPool"
                else None)
        raise Unsupported(
            "%s.%s" % (cls.__module__, cls.__name__),
            "it overrides HybridReqToTokenPool._init_mamba_pool and builds its own dense state "
            "pool", hint)
    return None


def _init_mamba_pool_around(original, self, *args, **kwargs):
    """HybridReqToTokenPool._init_mamba_pool AROUND hook: refusals, then the
    original with mamba_pool_cls = StepqMambaPool, then stepq's allocator."""
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    sa = _server_args()
    if sa is not None:
        for w in server_refusals(sa):
            logger.warning("stepq: %s", w)
    if a.get("enable_mamba_extra_buffer"):
        raise Unsupported(
            "the extra-buffer mamba radix strategy (enable_mamba_extra_buffer=True; "
            "--mamba-radix-cache-strategy extra_buffer / extra_buffer_lazy or 'auto' with "
            "overlap scheduling)",
            "its decode-time track copies run inside the CUDA graph on the dense conv and "
            "temporal rows (track_mamba_states_if_needed)",
            "Use --mamba-radix-cache-strategy no_buffer or --disable-radix-cache")
    pool_refusals(device=a.get("device"), enable_memory_saver=getattr(self, "enable_memory_saver", False),
                  speculative_num_draft_tokens=a.get("speculative_num_draft_tokens"),
                  enable_linear_replayssm=a.get("enable_linear_replayssm", False),
                  enable_gdn_replayssm_spec=a.get("enable_gdn_replayssm_spec", False),
                  envelope_layout=a.get("mamba_envelope_layout", False),
                  custom_mem_pool=os.environ.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL"))
    classes = _classes()
    self.mamba_pool_cls = classes.StepqMambaPool  # this instance only (see the module doc)
    try:
        result = original(*bound.args, **bound.kwargs)
    finally:
        self.__dict__.pop("mamba_pool_cls", None)
    if getattr(self, "mamba_ckpt_pool", None) is not None:
        raise Unsupported("--enable-int8-mamba-checkpoint",
                          "its store quantizes mamba_cache.temporal[:, slots] by slot")
    self.mamba_allocator = classes.StepqSlotAllocator(self.mamba_pool)
    _register_runtime_hooks(sa)
    return result


def _is_stepq_pool(pool):
    c = _built.get("classes")
    return c is not None and isinstance(pool, c.StepqMambaPool)


def _backend_base_init_after(result, self, model_runner=None, *args, **kwargs):
    """MambaAttnBackendBase.__init__ AFTER hook: only GDN and KDA backends."""
    pool = getattr(getattr(self, "req_to_token_pool", None), "mamba_pool", None)
    if not _is_stepq_pool(pool):
        return None
    cls = type(self)
    if (cls.__module__, cls.__name__) not in _SERVED_BACKENDS:
        raise Unsupported(
            "the linear-attention backend %s.%s" % (cls.__module__, cls.__name__),
            "only GDNAttnBackend (Gated DeltaNet) and KDAAttnBackend (Kimi Delta Attention) "
            "are served; the other backends and the models behind them (Mamba2, lightning, "
            "short conv, ...) read the dense temporal / conv tensors themselves")
    cfg = getattr(getattr(model_runner, "model_config", None), "hf_config", None)
    try:
        text = cfg.get_text_config() if cfg is not None else None
    except Exception:
        text = cfg
    name = type(text).__name__ if text is not None else ""
    if name in ("JetNemotronConfig", "JetVLMConfig"):
        raise Unsupported(
            "Jet-Nemotron (%s)" % name,
            "models/jet_nemotron.py passes layer_cache.temporal to its own kernel as "
            "initial_state_source")
    return None


def _swap_kernels(backend, arch, model_runner):
    pool = backend.req_to_token_pool.mamba_pool
    if not _is_stepq_pool(pool):
        return
    if pool.arch != arch:
        raise Unsupported("a %s backend with a %s map" % (arch.upper(), pool.arch.upper()),
                          "the map's arch must match the model")
    dtype = getattr(getattr(model_runner, "model_config", None), "dtype", None)
    name = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}.get(str(dtype))
    if dtype is not None and name is None:
        raise Unsupported("model dtype %s" % dtype, "stepq's decode takes fp32 or bf16 activations")
    # The pool opens for any map (slots and copies work everywhere); the steps
    # need kernels for its head shape and dtypes, asked once here (start-up).
    sp = pool.statepool
    for op, kw in (("decode", {"dtype": name or "bf16", "param_dtype": "fp32"}),
                   ("unpack", {"dtype": pool.temporal_dtype_name, "layout": "vk"}),
                   ("pack", {"dtype": pool.temporal_dtype_name, "layout": "vk"})):
        ok, why = sp.supports(op, **kw)
        if not ok:
            raise Unsupported("%s of this map on this device (%s)" % (op, kw), why)
    d = backend.kernel_dispatcher
    kernel = _classes().StepqLinearAttnKernel(pool, getattr(d, "extend_kernel", None))
    d.decode_kernel = d.extend_kernel = d.verify_kernel = kernel
    if hasattr(d, "tree_verify_kernel"):
        d.tree_verify_kernel = kernel
    d.supports_packed_decode = False
    logger.info("stepq: %s kernels: decode = stepq, extend = stepq around %s, verify refused",
                type(backend).__name__, type(kernel.dense_extend).__name__)


def _gdn_init_after(result, self, model_runner=None, *args, **kwargs):
    _swap_kernels(self, "gdn", model_runner)


def _kda_init_after(result, self, model_runner=None, *args, **kwargs):
    _swap_kernels(self, "kda", model_runner)


def _host_pool_init_before(self, device_pool=None, *args, **kwargs):
    if _is_stepq_pool(device_pool if device_pool is not None else kwargs.get("device_pool")):
        raise Unsupported(
            "the hierarchical cache's host pool (MambaPoolHost, --enable-hierarchical-cache)",
            "it reads mamba_cache.temporal[l].data_ptr() and copies the dense tensors per layer")
    return None


def _pd_slice_around(original, self, *args, **kwargs):
    raise Unsupported(
        "a PD state transfer between different attention-TP sizes (%s)" % original.__qualname__,
        "it slices the state tensors by head, and stepq pages hold all of a rank's heads packed "
        "together", "Run prefill and decode with the same attention-TP size")


def _mori_send_around(original, self, peer_info, *args, **kwargs):
    if getattr(peer_info, "decode_tp_size", None) != getattr(self, "attn_tp_size", None):
        _pd_slice_around(original, self)
    return original(self, peer_info, *args, **kwargs)


# --- the torch / SGLang classes, built on first use ------------------------

_built = {}


def _classes():
    with _lock:
        c = _built.get("classes")
        if c is None:
            c = _build_classes()
            _built["classes"] = c
        return c


def __getattr__(name):  # PEP 562: the classes need torch and SGLang
    if name in ("StepqMambaPool", "StepqSlotAllocator", "StepqLinearAttnKernel"):
        return getattr(_classes(), name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _build_classes():
    try:
        import torch
        from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase
        from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
        from sglang.srt.mem_cache.memory_pool import MambaPool
    except ImportError as e:
        raise ImportError("stepq.sglang's pool and kernel classes need torch and SGLang "
                          "(sglang.srt.mem_cache.memory_pool), which cannot be imported: %s"
                          % e) from e
    from . import StatePool

    nocompile = getattr(getattr(torch, "compiler", None), "disable", None) or (lambda f: f)

    class _DeviceBytes:
        """Device memory as __cuda_array_interface__ (torch.as_tensor shares
        it); keeps the StatePool that owns it alive."""

        def __init__(self, ptr, nbytes, owner):
            self._owner = owner
            self.__cuda_array_interface__ = {"shape": (int(nbytes),), "typestr": "|u1",
                                             "data": (int(ptr), False), "version": 2,
                                             "strides": None}

    class StepqMambaPool(MambaPool):
        """SGLang's MambaPool interface over a stepq StatePool (CUDA backend).

        Constructor: the keyword arguments HybridReqToTokenPool._init_mamba_pool
        passes. The map comes from STEPQ_MAP and must match cache_params and
        mamba_layer_ids exactly. ``mamba_cache`` is a MambaPool.State whose
        ``conv`` holds one real tensor, a strided view [L, size + 1, *conv]
        of the conv bytes in the pages, and whose ``temporal`` is
        PackedStates. Slot operations take SGLang's id tensors (read on the
        host) and run on the pool's stream, bracketed by a wait for the
        current torch stream and for the pool's stream.
        """

        def __init__(self, *, size, spec_state_size, cache_params, mamba_layer_ids, device,
                     enable_memory_saver=False, speculative_num_draft_tokens=None,
                     speculative_eagle_topk=None, enable_linear_replayssm=False,
                     linear_replayssm_cache_len=16, envelope_layout=False,
                     enable_gdn_replayssm_spec=False):
            pool_refusals(device=device, enable_memory_saver=enable_memory_saver,
                          speculative_num_draft_tokens=speculative_num_draft_tokens,
                          enable_linear_replayssm=enable_linear_replayssm,
                          enable_gdn_replayssm_spec=enable_gdn_replayssm_spec,
                          envelope_layout=envelope_layout,
                          custom_mem_pool=os.environ.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL"))
            path, smap = _served_map("StepqMambaPool")
            shape = cache_params.shape
            cdesc = cache_desc(cache_params, mamba_layer_ids)
            mdesc = map_desc(smap)
            tp_size = check_map(mdesc, cdesc)
            tp_rank = 0
            if tp_size > 1:
                from sglang.srt.runtime_context import get_parallel

                par = get_parallel()
                if par.attn_tp_size != tp_size:
                    raise Unsupported(
                        "attention-TP size %d with the map %s" % (par.attn_tp_size, path),
                        "the shapes imply %d ranks" % tp_size)
                tp_rank = par.attn_tp_rank
            dev = torch.device(device)
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            self._torch_device = torch.device("cuda", index)
            sp = StatePool(smap, size=size, device="cuda:%d" % index, tp_rank=tp_rank,
                           tp_size=tp_size)
            if sp.size != size:
                sp.close(force=True)
                raise StepqError("STEPQ_EINTERNAL", "StepqMambaPool: asked for %d slots, the "
                                 "pool has %d" % (size, sp.size))
            self.statepool, self.stepq_map = sp, smap
            self.arch = smap.arch
            self.tp_size, self.tp_rank = tp_size, tp_rank
            self.temporal_dtype = cache_params.dtype.temporal
            self.temporal_dtype_name = cdesc["temporal_dtype"]
            self.size = size
            self.device = device
            self.num_mamba_layers = len(mamba_layer_ids)
            self.conv_shard_groups = getattr(shape, "conv_shard_groups", None)
            # Attributes SGLang reads off any MambaPool; the features behind them are refused.
            self.debug_memory_pool = False
            self.enable_linear_replayssm = False
            self.enable_gdn_replayssm_spec = False
            self.linear_replayssm_cache_len = linear_replayssm_cache_len
            self.replayssm_write_pos = self.replayssm_cache_base = self.replayssm_is_flush = None
            self.replayssm_is_kda = False
            self.enable_custom_mem_pool, self.custom_mem_pool = False, None
            self.memory_saver_adapter = None
            conv = self._conv_view(shape.conv[0], cache_params.dtype.conv)
            hv, v, k = shape.temporal
            self.mamba_cache = MambaPool.State(
                conv=[conv],
                temporal=PackedStates(self, None, (self.num_mamba_layers, size + 1, hv, v, k),
                                      cache_params.dtype.temporal, self._torch_device))
            st = sp.stats()
            total = st["page_bytes"] * (size + 1)
            self.mem_usage = total / (1 << 30)
            dense = cache_params.mamba_cache_per_req * (size + 1)
            logger.info(
                "stepq: state pool (%s=%s: %s %s@%g, %d layers, tp %d/%d): %d slots of %d B, "
                "%.3f GB (a dense MambaPool of these slots: %.3f GB)",
                MAP_ENV, path, smap.arch, smap.method, smap.budget_bits, smap.n_layers,
                tp_rank, tp_size, size, st["page_bytes"], self.mem_usage, dense / (1 << 30))

        def _conv_view(self, conv_shape, conv_dtype):
            sp = self.statepool
            infos = sp.buffer_infos()
            if not infos or infos[0]["name"] != "pages":
                raise StepqError("STEPQ_EINTERNAL", "buffer_infos()[0] is not the pages: %r" % infos)
            pages = infos[0]
            item = torch.empty((), dtype=conv_dtype).element_size()
            page = pages["item_bytes"]
            views = [sp.conv_state(l) for l in range(sp.n_layers)]
            offs = [cv["base"] - pages["ptr"] for cv in views]
            numel = _prod(conv_shape)
            for l, cv in enumerate(views):
                if cv["slot_stride"] != page or cv["bytes"] != numel * item:
                    raise StepqError("STEPQ_EINTERNAL", "layer %d conv view %r does not match "
                                     "SGLang's %s x %d B per slot" % (l, cv, list(conv_shape), item))
            step = offs[1] - offs[0] if len(offs) > 1 else numel * item
            if (any(offs[i] != offs[0] + i * step for i in range(len(offs)))
                    or any(x % item for x in (offs[0], step, page, pages["bytes"]))):
                raise StepqError("STEPQ_EINTERNAL", "the conv states are not evenly spaced in "
                                 "%d-byte elements (offsets %s, page %d)" % (item, offs, page))
            u8 = torch.as_tensor(_DeviceBytes(pages["ptr"], pages["bytes"], sp), device=self._torch_device)
            if u8.data_ptr() != pages["ptr"] or u8.device != self._torch_device:
                raise StepqError("STEPQ_EINTERNAL", "the pages tensor is at %#x on %s, expected "
                                 "%#x on %s" % (u8.data_ptr(), u8.device, pages["ptr"],
                                                self._torch_device))
            flat = u8.view(conv_dtype)
            inner, acc = [], 1
            for d in reversed(conv_shape):
                inner.insert(0, acc)
                acc *= int(d)
            return torch.as_strided(flat, (sp.n_layers, self.size + 1) + tuple(conv_shape),
                                    (step // item, page // item) + tuple(inner), offs[0] // item)

        # --- slot operations --------------------------------------------

        def _wait_torch(self):
            torch.cuda.current_stream(self._torch_device).synchronize()

        def clear_slots(self, indices):
            self._wait_torch()
            self.statepool.clear_slots(indices)
            self.statepool.sync()

        def copy_from(self, src_indices, dst_indices):
            self._wait_torch()
            self.statepool.copy_from(src_indices, dst_indices)
            self.statepool.sync()

        def get_cpu_copy(self, indices):
            """One uint8 CPU tensor [len(indices), page_bytes] (not SGLang's
            (conv, temporal) tuple): callers hand it back to load_cpu_copy."""
            self._wait_torch()
            return torch.from_numpy(self.statepool.get_cpu_copy(indices))

        def load_cpu_copy(self, mamba_cache_cpu, indices):
            self._wait_torch()
            if isinstance(mamba_cache_cpu, tuple):
                raise Unsupported("a dense (conv, temporal) host copy",
                                  "load_cpu_copy takes what this pool's get_cpu_copy returned")
            self.statepool.load_cpu_copy(mamba_cache_cpu, indices)

        def get_contiguous_buf_infos(self):
            return self.statepool.get_contiguous_buf_infos()

        def get_state_dim_per_tensor(self):
            return []  # no head dimension to slice: packed pages (hetero-TP is refused)

        def get_state_conv_shard_groups(self):
            return []

        def get_speculative_mamba2_params_all_layers(self):
            raise Unsupported("get_speculative_mamba2_params_all_layers (speculative decoding)",
                              "a stepq pool has no intermediate states")

        def _allocate_deduplicated_conv_window(self, *args, **kwargs):
            raise Unsupported("intermediate conv windows (speculative decoding)",
                              "a stepq pool has no intermediate states")

        def close(self):
            self.statepool.close(force=True)

    class StepqSlotAllocator(MambaSlotAllocator):
        """MambaSlotAllocator over the StatePool's own slots: alloc returns
        an int64 tensor on the pool's device (or None), free takes SGLang's
        id tensors (a double free is STEPQ_EDOUBLEFREE, not silently
        accepted); alloc_group_begin / alloc_group_end are the base
        class's, over these."""

        def __init__(self, mamba_pool):  # not the base's: it builds a free list
            self.mamba_pool = mamba_pool
            self._sp = mamba_pool.statepool
            self.size = mamba_pool.size
            self.device = mamba_pool.device
            self._alloc_iter = None

        def available_size(self):
            return self._sp.available_size()

        def _do_alloc(self, need_size):
            ids = self._sp.alloc(need_size)
            if ids is None:
                return None
            return torch.tensor(ids, dtype=torch.int64, device=self.device)

        def free(self, free_index):
            if hasattr(free_index, "numel") and free_index.numel() == 0:
                return
            self._sp.free(free_index)

        def clear(self):
            self._alloc_iter = None
            self._sp.clear()

        @property
        def free_slots(self):
            """The free slot ids (a diagnostic: one library call per slot)."""
            ids = [s for s in range(1, self.size + 1) if not self._sp.is_allocated(s)]
            return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _layer_states(states, pool, op):
        if not isinstance(states, PackedStates) or states.layer is None or states.owner is not pool:
            raise Unsupported(
                "%s on %s" % (op, type(states).__name__),
                "the stepq kernel takes one layer of its own pool's PackedStates (from "
                "mamba2_layer_cache), not a dense tensor")
        return states

    def _per_request(x, B, name):
        if x.dim() == 4 and x.shape[0] == 1 and x.shape[1] == B:
            return x[0]
        if x.dim() in (2, 3) and x.shape[0] == B:
            return x
        raise Unsupported("%s of shape %s for %d requests" % (name, list(x.shape), B),
                          "stepq's decode takes one token per request ([1, B, heads, dim])")

    class StepqLinearAttnKernel(LinearAttnKernelBase):
        """LinearAttnKernelBase over a StepqMambaPool, for GDN and KDA.

        decode: stepq_pool_decode_step (unpack, gated delta step, repack) with
        the gating, sigmoid(b) and l2norm in the kernel, as SGLang's fused
        kernels do. extend: stepq unpacks the slots' states into a dense
        [n, HV, V, K] buffer of the pool's SSM dtype, SGLang's own chunk
        kernel (the dispatcher's extend kernel) runs on it with identity
        indices, stepq packs the final states. target_verify: refused.
        """

        supports_packed_decode = False
        supports_prefill = True
        supports_target_verify = False

        def __init__(self, mamba_pool, dense_extend):
            self.pool = mamba_pool
            self.dense_extend = dense_extend

        def _gate_params(self, A_log, dt_bias):
            sp = self.pool.statepool
            HV, K = sp.num_v_heads, sp.head_k_dim
            A = A_log.reshape(-1)
            D = dt_bias.reshape(HV, K) if self.pool.arch == "kda" else dt_bias.reshape(-1)
            if D.dtype != A.dtype:
                D = D.to(A.dtype)  # per call: tracks in-place weight updates; captured in graphs
            return A.contiguous(), D.contiguous()

        @nocompile
        def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices,
                   query_start_loc=None, **kwargs):
            st = _layer_states(ssm_states, self.pool, "decode")
            sp = self.pool.statepool
            B = int(cache_indices.shape[0])
            ids = cache_indices
            if ids.dtype != torch.int32 or not ids.is_contiguous():
                ids = ids.to(torch.int32).contiguous()
            qq, kk, vv = (_per_request(x, B, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
            A, D = self._gate_params(A_log, dt_bias)
            out = vv.new_zeros((1, B, sp.num_v_heads, sp.head_v_dim))  # padded rows stay 0
            sp.decode(st.layer, qq, kk, vv, a.reshape(B, -1), b.reshape(B, -1), A, D,
                      cache_indices=ids, out=out[0])
            return out

        @nocompile
        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc,
                   **kwargs):
            if isinstance(ssm_states, _Gathered):
                gathered, st = ssm_states, _layer_states(ssm_states.parent, self.pool, "extend")
                ids = ssm_states.ids
            else:
                gathered, st = None, _layer_states(ssm_states, self.pool, "extend")
                ids = cache_indices
            if self.dense_extend is None:
                raise Unsupported("extend without SGLang's chunk kernel",
                                  "the kernel dispatcher had no extend kernel")
            sp = self.pool.statepool
            n = int(ids.shape[0])
            ids32 = ids if ids.dtype == torch.int32 and ids.is_contiguous() else \
                ids.to(torch.int32).contiguous()
            dense = sp.new_states(n, "vk", dtype=self.pool.temporal_dtype)
            identity = torch.arange(n, dtype=cache_indices.dtype, device=cache_indices.device)
            result = []

            def chunk_fn(states):
                result.append(self.dense_extend.extend(
                    q, k, v, g, beta, ssm_states=states, cache_indices=identity,
                    query_start_loc=query_start_loc, **kwargs))
                return states  # SGLang's chunk kernels write the final states in place

            sp.extend(st.layer, ids32, chunk_fn, states=dense, layout="vk")
            if gathered is not None:
                gathered.packed = True
            return result[0]

        def target_verify(self, *args, **kwargs):
            raise Unsupported("target_verify (speculative decoding)",
                              "stepq has no multi-token verify step")

        def packed_decode(self, *args, **kwargs):
            raise Unsupported("packed_decode", "stepq's kernel does not advertise it "
                              "(supports_packed_decode = False)")

    class _Classes:
        pass

    c = _Classes()
    c.StepqMambaPool, c.StepqSlotAllocator = StepqMambaPool, StepqSlotAllocator
    c.StepqLinearAttnKernel = StepqLinearAttnKernel
    return c
