"""A transformers cache whose recurrent states live in a stepq StatePool.

For the hybrid linear-attention models of transformers 5 (Qwen3.5 / Qwen3-Next
Gated DeltaNet, Kimi-Linear KDA)::

    import torch, stepq.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("shared/models/tiny-gdn", dtype=torch.bfloat16).cuda().eval()
    pool = stepq.hf.open_pool(model, "config/calibrated/tiny-gdn/stepq@4.json", size=8)
    with stepq.hf.StepqCache(model, pool) as cache:  # one slot per batch row, taken at the prefill
        out = model.generate(ids, past_key_values=cache, max_new_tokens=64, do_sample=False)
    pool.close()

Importing this module needs torch and transformers (the rest of the package
needs neither).

Conventions:

* The recurrent layers are the modules hf_names.recurrent_layers() finds; the
  recurrent-layer index of a layer (the pool's `layer`) is the rank of its
  model layer id among them, which is the map's order: open_pool() and
  check_map() compare the map's layer_ids with the model's.
* Routing: the layers' kernel functions (hf_names: module functions such as
  torch_chunk_gated_delta_rule / recurrent_kimi_delta_attention, or layer
  attributes in some releases) are wrapped once, and a forward pre-hook on
  every recurrent layer looks for a StepqCache among the layer's arguments.
  A kernel call inside a layer that got a StepqCache is routed to the pool;
  any other call (another cache, use_cache=False, another model of the same
  class) runs the original function unchanged.
* Prefill (the chunk kernel): the model's own chunk kernel runs, with
  initial_state None for a fresh request or the rows' states unpacked from
  the pool when the cache already holds a prefix (a multi-token forward
  after the first), and its final state [B, HV, K, V] is packed into each
  row's slot (StatePool.pack: fit, quantize, write).
* Decode (the one-token recurrent kernel): StatePool.decode on the kernel's
  own inputs. q and k arrive as [B, 1, Hq, K]; Hq is H, or HV when the layer
  repeated the q/k heads to the value heads (repeat_interleave, as the
  transformers 5.17 on the GPU host does; later sources repeat only for old
  flash-linear-attention), which is undone by taking every (HV/H)-th head
  (that the heads are such a repeat is checked once per model, at a
  prefill). g is
  the log-space gate (GDN [B, 1, HV], KDA [B, 1, HV, K]) and beta is already
  sigmoid(b), so the pool gets a = g, b = beta and no A_log / dt_bias (no
  gate, no sigmoid in the kernel); l2norm is the kernel's
  use_qk_l2norm_in_kernel, the scale its `scale` argument or K^-1/2 (what
  transformers' torch kernels apply after the l2norm). The step runs in fp32
  (as transformers' torch recurrences compute); the output is cast to q's
  dtype.
* The cache's layers[L].recurrent_states[0] holds a [B, 0] placeholder, never
  a state: the layer hands it back as initial_state, and the wrapper hands it
  to the layer as the "final state", which the cache keeps. A dense state
  reaching update_recurrent_state means a kernel ran around the hook: HFError.
* The conv states and the attention layers' keys and values are transformers'
  own (the DynamicCache layers), updated by the model as usual.
* Rows and slots: batch row i is slot slots[i] of its pool. A cache over one
  pool without slots takes them at the first prefill (B rows, all or nothing)
  and gives them back at release(); slots passed in stay the caller's. Rows
  may be split over several pools (StepqCache.segments: consecutive rows of
  one pool, e.g. one precision map per group of rows).
* Graph-friendliness: the decode hook does no host synchronisation, reads no
  device memory and keeps one int32 device tensor of slot ids per pool
  segment, rebuilt only when the rows change; its temporaries come from
  torch's caching allocator.
* Refused with HFError: beam search and num_return_sequences > 1
  (reorder_cache, batch_repeat_interleave, batch_select_indices), assisted
  decoding (crop), packed sequences (cu_seqlens / cu_seq_lens_q). The cache
  is built without offloading.

Errors: a map or pool for another model shape, a pool on another device than
the model, a wrong slot list: StepqArgumentError (a ValueError) naming it; a
transformers release that does not do what this module expects: HFError or
HFNamesError, naming what was looked for.
"""

import copy
import inspect
import itertools
import threading
import weakref

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("stepq.hf needs torch (%s); the rest of the stepq package does not" % e) from None
try:
    import transformers
    from transformers.cache_utils import DynamicCache
except ImportError as e:  # pragma: no cover
    raise ImportError("stepq.hf needs transformers >= 5 (%s)" % e) from None
try:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # pragma: no cover
    raise ImportError("stepq.hf: transformers %s has no transformers.cache_utils.LinearAttentionCacheLayerMixin "
                      "(the linear-attention cache layers of transformers 5); this module was written against "
                      "5.17" % getattr(transformers, "__version__", "?")) from None

from . import hf_names
from .errors import StepqError, bad_arg
from .map import Map, load_map
from .pool import StatePool

__all__ = ["StepqCache", "HFError", "HFNamesError", "open_pool", "check_map", "model_layer_ids"]

HFNamesError = hf_names.HFNamesError
_MARKER = "__stepq_hf__"


class HFError(RuntimeError):
    """transformers did not do what stepq.hf expects of it (another release,
    an unsupported generation mode); the message says what was seen."""


# --- the model: its shape, its recurrent layers, the kernel wrappers -------

class _Model:
    """What stepq.hf knows of one model: (arch, H, HV, K, V), its recurrent
    layer ids, their recurrent indices, and the hooks installed on them."""

    def __init__(self, model):
        self.arch, self.H, self.HV, self.K, self.V = hf_names.model_shape(model.config)
        if self.HV % self.H:
            raise HFError("%s: %d value heads are not a multiple of %d q/k heads"
                          % (type(model).__name__, self.HV, self.H))
        layers, mods = hf_names.recurrent_layers(model)
        self.config = model.config
        self.layer_ids = tuple(L for L, _ in layers)
        self.index = {L: i for i, L in enumerate(self.layer_ids)}
        self._model = weakref.ref(model)
        _model_device(model)
        self.model_name = type(model).__name__
        self.qk_checked = False
        _install_kernels(layers, mods)
        me = weakref.ref(self)
        for L, m in layers:
            m.register_forward_pre_hook(_make_pre_hook(me, L), with_kwargs=True)
            m.register_forward_hook(_post_hook, always_call=True)

    @property
    def device(self):
        """The model's device now (it may have been moved since the first cache)."""
        model = self._model()
        if model is None:
            raise HFError("the model of this StepqCache is gone")
        return _model_device(model)

    def describe(self):
        return "%s (%s: H=%d, HV=%d, K=%d, V=%d, recurrent layers %s)" % (
            self.model_name, self.arch, self.H, self.HV, self.K, self.V, list(self.layer_ids))


def _model_device(model):
    try:
        return next(model.parameters()).device
    except StopIteration:
        raise bad_arg("model: %s has no parameters to tell its device" % type(model).__name__) from None


def _model_info(model):
    """The _Model of a model, made (and the hooks installed) on first use."""
    info = model.__dict__.get("_stepq_hf")
    if info is None:
        info = _Model(model)
        model.__dict__["_stepq_hf"] = info  # outside nn.Module's attribute machinery
    return info


def model_layer_ids(model):
    """The model layer ids of the recurrent layers, in the pool's layer order."""
    return _model_info(model).layer_ids


# The running recurrent layer of this thread: a stack of [cache or None, layer id, inside].
_tls = threading.local()


def _stack():
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


def _make_pre_hook(info_ref, layer_id):
    def pre(module, args, kwargs):
        cache = None
        for x in itertools.chain(args, kwargs.values()):
            if isinstance(x, StepqCache):
                cache = x
                break
        _stack().append([cache, layer_id, False])  # first: the always-called post hook pops it
        if cache is not None and cache._info is not info_ref():
            raise HFError("layer %d of %s got a StepqCache made for another model (%s)"
                          % (layer_id, info_ref().model_name, cache._info.model_name))
    return pre


def _post_hook(module, args, output):
    s = _stack()
    if s:
        s.pop()


def _install_kernels(layers, mods):
    """Wraps the kernels (hf_names.wrap_kernels); the module-level ones are
    shared by every model of the module, so a second model finds them wrapped
    already. Both a prefill and a decode kernel must be reachable."""
    try:
        hf_names.wrap_kernels(layers, mods, _wrap, _MARKER)
    except HFNamesError:
        pass  # nothing new to wrap; what is wrapped already is checked below
    import importlib
    roles = set()
    for modname in mods:
        mod = importlib.import_module(modname)
        for kn in hf_names.all_kernel_names():
            if getattr(getattr(mod, kn, None), _MARKER, False):
                roles.add(hf_names.kernel_role(kn))
    for _, m in layers:
        for an in hf_names.LAYER_ATTRS:
            if getattr(getattr(m, an, None), _MARKER, False):
                roles.add(hf_names.kernel_role(an))
    if roles != {"prefill", "decode"}:
        raise HFNamesError("stepq.hf: found %s kernel to wrap in %s (looked for the functions %s and the layer "
                           "attributes %s)" % ("no prefill" if "prefill" not in roles else "no decode",
                                               ", ".join(sorted(mods)), ", ".join(hf_names.all_kernel_names()),
                                               ", ".join(hf_names.LAYER_ATTRS)))


# The kernel arguments stepq.hf reads, by the names kernels give them (transformers' torch kernels:
# query, key, value; flash-linear-attention's: q, k, v).
_ALIASES = {"q": ("query", "q"), "k": ("key", "k"), "v": ("value", "v"), "g": ("g", "gate"), "beta": ("beta",),
            "initial_state": ("initial_state",), "output_final_state": ("output_final_state",),
            "l2norm": ("use_qk_l2norm_in_kernel",), "scale": ("scale",)}
# Packed-sequence boundaries, by keyword: GDN layers pass cu_seqlens= (popped from their cu_seq_lens_q);
# the KDA layers forward their **kwargs, where they arrive as cu_seq_lens_q.
_PACKED_NAMES = ("cu_seqlens", "cu_seq_lens_q")
_DEFAULT_ORDER = ("query", "key", "value", "g", "beta")


def _positional_names(fn):
    """The kernel's positional parameter names (its signature, through functools.wraps), else the order
    every kernel seen shares: q, k, v, g, beta."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return _DEFAULT_ORDER
    names = tuple(p.name for p in sig.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    return names if len(names) >= 5 else _DEFAULT_ORDER


class _Call:
    """One kernel call as the layer made it: read and replace arguments by name, whether the layer
    passed them by position or by keyword, then run the original with them."""

    def __init__(self, name, fn, params, args, kwargs):
        if len(args) > len(params):
            raise HFError("%s got %d positional arguments, its signature names %d (%s)"
                          % (name, len(args), len(params), ", ".join(params)))
        self.name, self.fn, self.params, self.args, self.kwargs = name, fn, params, list(args), dict(kwargs)

    def _where(self, key):
        names = _ALIASES[key]
        for n in names:
            if n in self.kwargs:
                return False, n
        for n in names:
            if n in self.params and self.params.index(n) < len(self.args):
                return True, self.params.index(n)
        return None

    def get(self, key, default=None):
        w = self._where(key)
        if w is None:
            return default
        return self.args[w[1]] if w[0] else self.kwargs[w[1]]

    def set(self, key, value):
        w = self._where(key)
        if w is None:
            self.kwargs[_ALIASES[key][0]] = value
        elif w[0]:
            self.args[w[1]] = value
        else:
            self.kwargs[w[1]] = value

    def run(self):
        return self.fn(*self.args, **self.kwargs)


def _wrap(fn, name):
    role = hf_names.kernel_role(name)
    params = _positional_names(fn)

    def stepq_kernel(*args, **kwargs):
        s = _stack()
        top = s[-1] if s else None
        if top is None or top[0] is None or top[2]:
            return fn(*args, **kwargs)  # not a StepqCache forward, or a kernel inside our own call
        cache, layer_id = top[0], top[1]
        call = _Call(name, fn, params, args, kwargs)
        packed = [n for n in _PACKED_NAMES if call.kwargs.get(n) is not None]
        if packed:
            raise HFError("%s: packed sequences (%s) are not supported by stepq.hf" % (name, packed[0]))
        if role == "decode":
            return cache._decode(layer_id, call)
        top[2] = True
        try:
            return cache._prefill(layer_id, call)
        finally:
            top[2] = False

    setattr(stepq_kernel, _MARKER, True)
    stepq_kernel.__wrapped__ = fn
    stepq_kernel.__name__ = getattr(fn, "__name__", name)
    return stepq_kernel


# --- maps and pools ----------------------------------------------------------

def check_map(model, map):
    """Refuses (StepqArgumentError naming both) a map that is not for this
    model: architecture, q/k and value heads, head dims, recurrent layer ids."""
    info = _model_info(model)
    got = (map.arch, map.num_k_heads, map.num_v_heads, map.head_k_dim, map.head_v_dim)
    want = (info.arch, info.H, info.HV, info.K, info.V)
    what = map.path or map.model_name or "the map"
    if got != want:
        raise bad_arg("map %s: %s H=%d HV=%d K=%d V=%d, but the model is %s"
                      % ((what,) + got + (info.describe(),)), "STEPQ_ESHAPE")
    if tuple(map.layer_ids) != info.layer_ids:
        raise bad_arg("map %s: recurrent layers %s, but the model's are %s (%s)"
                      % (what, list(map.layer_ids), list(info.layer_ids), info.model_name), "STEPQ_ESHAPE")


def open_pool(model, map, size=None, device=None, **kwargs):
    """A StatePool for this model: `map` a stepq.Map or a path, checked with
    check_map(); device default the model's ("cuda:N" or "cpu"); size and the
    other keyword arguments as StatePool's."""
    m = load_map(map) if not isinstance(map, Map) else map
    try:
        check_map(model, m)
        if device is None:
            dev = _model_info(model).device
            device = "cpu" if dev.type == "cpu" else "cuda:%d" % (dev.index or 0)
        return StatePool(m, size=size, device=device, **kwargs)
    finally:
        if m is not map:
            m.close()


def _check_pool(info, pool):
    if not isinstance(pool, StatePool):
        raise bad_arg("pool: a stepq.StatePool, not %s" % type(pool).__name__)
    got = (pool.arch, pool.num_k_heads, pool.num_v_heads, pool.head_k_dim, pool.head_v_dim, pool.n_layers)
    want = (info.arch, info.H, info.HV, info.K, info.V, len(info.layer_ids))
    if got != want:
        raise bad_arg("pool %r: %s H=%d HV=%d K=%d V=%d, %d layers, but the model is %s (a map for another "
                      "model, or a tensor-parallel rank's pool)" % ((pool,) + got + (info.describe(),)),
                      "STEPQ_ESHAPE")
    dev = info.device
    mdev = "cpu" if dev.type == "cpu" else ("cuda", dev.index or 0)
    if pool.device != mdev:
        raise bad_arg("pool %r lives on %s, the model on %s" % (pool, _devname(pool.device), dev))


def _devname(d):
    return d if isinstance(d, str) else "%s:%d" % d


def _torch_device(pool_device):
    return torch.device("cpu") if pool_device == "cpu" else torch.device("cuda", pool_device[1])


def _inner_contiguous(x):
    """Whether every dim after the first is row-major contiguous (size-1 dims any stride)."""
    expect = 1
    for d, st in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if d != 1 and st != expect:
            return False
        expect *= d
    return True


def _f32_rows(x):
    """x as fp32 with each request's elements contiguous (requests may stay strided)."""
    if x.dtype != torch.float32:
        x = x.float()
    if not _inner_contiguous(x):
        x = x.contiguous()
    return x


# --- the cache -----------------------------------------------------------------

class StepqCache(DynamicCache):
    """transformers' DynamicCache (attention keys/values, conv states) with the
    recurrent states in stepq pools. See the module docstring for the
    conventions.

    Args:
        model: the transformers model (Qwen3.5 / Qwen3-Next GDN, Kimi-Linear KDA).
        pool: a stepq.StatePool for this model (open_pool()), on the model's device.
        slots: one slot id of `pool` per batch row, allocated by the caller and
            left to it; None: the cache allocates one per row at the first
            prefill and frees them at release() (or at `with` exit).
    """

    def __init__(self, model, pool, slots=None):
        info = _model_info(model)
        _check_pool(info, pool)
        rows = None if slots is None else [(pool, s) for s in self._slot_list(slots, "slots")]
        self._setup(info, rows, pool_for_alloc=pool if slots is None else None)

    @classmethod
    def segments(cls, model, segments):
        """A cache whose rows are split over several pools: segments is a list
        of (pool, slots); rows come in that order (slots left to the caller)."""
        info = _model_info(model)
        rows = []
        for i, seg in enumerate(segments):
            try:
                pool, slots = seg
            except (TypeError, ValueError):
                raise bad_arg("segments[%d]: a (pool, slots) pair, not %r" % (i, seg)) from None
            _check_pool(info, pool)
            rows.extend((pool, s) for s in cls._slot_list(slots, "segments[%d] slots" % i))
        if not rows:
            raise bad_arg("segments: no rows")
        self = cls.__new__(cls)
        self._setup(info, rows, pool_for_alloc=None)
        return self

    @staticmethod
    def _slot_list(slots, what):
        if hasattr(slots, "tolist"):
            slots = slots.tolist()
        out = []
        for i, s in enumerate(slots):
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise bad_arg("%s[%d]: %r is not an allocated slot id (1..size)" % (what, i, s))
            out.append(s)
        return out

    def _setup(self, info, rows, pool_for_alloc):
        missing = [m for m in ("update_recurrent_state", "update_conv_state", "has_previous_state", "reorder_cache",
                               "get_seq_length") if not callable(getattr(DynamicCache, m, None))]
        if missing:
            raise HFError("transformers %s: DynamicCache has no %s; stepq.hf builds on the transformers 5 cache "
                          "of linear-attention layers" % (transformers.__version__, ", ".join(missing)))
        try:
            DynamicCache.__init__(self, config=info.config)
        except TypeError as e:
            raise HFError("transformers %s: DynamicCache(config=...) failed (%s); stepq.hf builds on the "
                          "transformers 5 cache" % (transformers.__version__, e)) from None
        for L in info.layer_ids:
            layer = self.layers[L] if L < len(self.layers) else None
            if not isinstance(layer, LinearAttentionCacheLayerMixin) or not all(
                    hasattr(layer, a) for a in ("conv_states", "recurrent_states")):
                raise HFError("transformers %s: DynamicCache(config) gives layer %d a %s, not a linear-attention "
                              "cache layer with conv_states and recurrent_states"
                              % (transformers.__version__, L, type(layer).__name__))
        self._info = info
        self._alloc_pool = pool_for_alloc
        self._owned = []  # (pool, slot) the cache allocated and frees
        self._rows = []
        self._segs = []
        self._placeholder = None
        # Recurrent-layer calls routed to the pools (Python calls: a CUDA graph's replays are not counted).
        self.kernel_calls = {"prefill": 0, "decode": 0}
        if rows:
            self._set_rows(rows)

    # --- rows and slots ------------------------------------------------------

    def _set_rows(self, rows):
        seen = set()
        for p, s in rows:
            if (id(p), s) in seen:
                raise bad_arg("slots: slot %d of %r appears twice (one row per slot)" % (s, p))
            seen.add((id(p), s))
        self._rows = list(rows)
        segs = []
        for pool, grp in itertools.groupby(enumerate(self._rows), key=lambda x: x[1][0]):
            grp = list(grp)
            r0, r1 = grp[0][0], grp[-1][0] + 1
            ids = torch.tensor([s for _, (_, s) in grp], dtype=torch.int32, device=_torch_device(pool.device))
            segs.append((pool, r0, r1, ids))
        self._segs = segs
        self._placeholder = torch.empty((len(rows), 0), dtype=torch.float32, device=self._info.device)

    @property
    def slots(self):
        """The slot id of each batch row (a list)."""
        return [s for _, s in self._rows]

    @property
    def pools(self):
        """The pool of each batch row (a list)."""
        return [p for p, _ in self._rows]

    @property
    def batch_rows(self):
        return len(self._rows)

    def _ensure_rows(self, B, what):
        if self._rows:
            if len(self._rows) != B:
                raise bad_arg("%s: a batch of %d rows, but the cache has %d (slots %s)"
                              % (what, B, len(self._rows), self.slots), "STEPQ_ESHAPE")
            return
        pool = self._alloc_pool
        if pool is None:
            raise HFError("%s: the cache has no rows (released, or every row selected away)" % what)
        ids = pool.alloc(B)
        if ids is None:
            raise StepqError("STEPQ_ENOSPC", "%s: %d slots needed for the batch, %d free in %r"
                             % (what, B, pool.available_size(), pool))
        self._owned.extend((pool, s) for s in ids)
        self._set_rows([(pool, s) for s in ids])

    def release(self):
        """Frees the slots the cache allocated; the cache has no rows after it."""
        owned, self._owned = self._owned, []
        by_pool = {}
        for p, s in owned:
            by_pool.setdefault(id(p), (p, []))[1].append(s)
        for p, ids in by_pool.values():
            p.free(ids)
        self._rows, self._segs, self._placeholder = [], [], None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def health(self):
        """The health word (stepq.HEALTH_* bits) of each row's slot."""
        out = [0] * len(self._rows)
        for pool, r0, r1, _ in self._segs:
            out[r0:r1] = pool.health(self.slots[r0:r1])
        return out

    # --- batch surgery for a scheduler ----------------------------------------

    def select_rows(self, rows):
        """Keeps the given batch rows (indices, in that order) of every layer:
        attention keys/values, conv states and the slot mapping; slots the cache
        owns whose rows are dropped are freed."""
        rows = list(rows)
        if not rows:
            raise bad_arg("rows: keep at least one row (drop the cache instead)")
        if any(not 0 <= r < len(self._rows) for r in rows) or len(set(rows)) != len(rows):
            raise bad_arg("rows: %s are not distinct rows of 0..%d" % (rows, len(self._rows) - 1))
        idx = torch.tensor(rows, dtype=torch.long, device=self._info.device)
        DynamicCache.reorder_cache(self, idx)  # transformers' own per-layer index_select
        kept = [self._rows[r] for r in rows]
        dropped = [x for x in self._rows if x not in kept]
        self._set_rows(kept)
        _set_batch_size(self.layers, len(kept))
        self._free_owned(dropped)

    def _free_owned(self, rows):
        drop = [x for x in self._owned if x in rows]
        if drop:
            self._owned = [x for x in self._owned if x not in drop]
            by_pool = {}
            for p, s in drop:
                by_pool.setdefault(id(p), (p, []))[1].append(s)
            for p, ids in by_pool.values():
                p.free(ids)

    def extend_rows(self, other):
        """Appends the rows of `other` (a StepqCache of the same model after
        its prefill) to this cache: conv states are concatenated, attention
        keys/values left-padded with zeros to the longer of the two and
        concatenated. Returns (pad_self, pad_other), the positions added on the
        left of this cache's rows and of other's: the caller's attention_mask
        must mark them 0. `other` is left without rows (its slots move here,
        with their ownership)."""
        if not isinstance(other, StepqCache) or other._info is not self._info:
            raise bad_arg("other: a StepqCache of the same model")
        if not self._rows or not other._rows:
            raise bad_arg("extend_rows: both caches need rows (run the prefill first)")
        clash = set(self._rows) & set(other._rows)
        if clash:
            raise bad_arg("extend_rows: slots %s are rows of both caches" % sorted(s for _, s in clash))
        if len(self.layers) != len(other.layers):
            raise HFError("extend_rows: %d layers and %d" % (len(self.layers), len(other.layers)))
        t_self, t_other = _kv_length(self.layers), _kv_length(other.layers)
        T = max(t_self, t_other)
        for i, (a, b) in enumerate(zip(self.layers, other.layers)):
            if type(a) is not type(b):
                raise HFError("extend_rows: layer %d is a %s here and a %s there" % (i, type(a).__name__,
                                                                                     type(b).__name__))
            _cat_layer(i, a, b, T - t_self, T - t_other)
        self._owned.extend(other._owned)
        other._owned = []
        rows = self._rows + other._rows
        other._rows, other._segs, other._placeholder = [], [], None
        self._set_rows(rows)
        _set_batch_size(self.layers, len(rows))
        return T - t_self, T - t_other

    def trim_left(self, n):
        """Drops the first n positions of every attention layer's keys and
        values (positions that are padding in every row)."""
        if n <= 0:
            return
        for i, layer in enumerate(self.layers):
            if not _has_kv(layer):
                continue
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.dim() < 2 or keys.shape[-2] < n:
                raise HFError("trim_left: layer %d (%s) has no %d positions to drop"
                              % (i, type(layer).__name__, n))
            layer.keys, layer.values = keys[..., n:, :], values[..., n:, :]

    def fork(self, slots=None, pool=None):
        """Prefix copy-on-write: a new cache with copies of this cache's
        attention keys/values and conv states whose row i maps to slots[i]
        (of the row's pool), the packed pages copied into them
        (StatePool.copy_from). slots None: allocated from this cache's pools
        and owned by the new cache. `pool` may give the pool for every row
        when this cache spans one pool."""
        if not self._rows:
            raise bad_arg("fork: the cache has no rows")
        new = StepqCache.__new__(StepqCache)
        new._setup(self._info, None, pool_for_alloc=None)
        for i, layer in enumerate(self.layers):
            new.layers[i] = _clone_layer(layer)
        owned = []
        if slots is None:
            rows = []
            for p, r0, r1, _ in self._segs:
                ids = p.alloc(r1 - r0)
                if ids is None:
                    for q, s in owned:
                        q.free([s])
                    raise StepqError("STEPQ_ENOSPC", "fork: %d slots needed, %d free in %r"
                                     % (r1 - r0, p.available_size(), p))
                owned.extend((p, s) for s in ids)
                rows.extend((p, s) for s in ids)
        else:
            slots = self._slot_list(slots, "slots")
            if len(slots) != len(self._rows):
                raise bad_arg("slots: %d ids for %d rows" % (len(slots), len(self._rows)), "STEPQ_ESHAPE")
            rows = [(self._rows[i][0] if pool is None else pool, s) for i, s in enumerate(slots)]
        try:
            for p, r0, r1, _ in self._segs:
                if rows[r0][0] is not p:
                    raise bad_arg("fork: pages cannot be copied between pools (%r and %r)" % (p, rows[r0][0]))
                p.copy_from(self.slots[r0:r1], [s for _, s in rows[r0:r1]])
        except BaseException:
            for q, s in owned:
                q.free([s])
            raise
        new._owned = owned
        new._set_rows(rows)
        return new

    # --- what the wrapped kernels call ------------------------------------

    def _check_inputs(self, layer_id, name, q, k, v, g, beta):
        info = self._info
        if q is None or k is None or v is None or g is None or beta is None:
            raise HFError("%s (layer %d): q, k, v, g and beta are needed; got %s" % (
                name, layer_id, ", ".join("%s=%s" % (n, "None" if x is None else "tensor")
                                          for n, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)))))
        B, T = q.shape[0], q.shape[1]
        hq = q.shape[2] if q.dim() == 4 else -1
        g_want = (B, T, info.HV, info.K) if info.arch == "kda" else (B, T, info.HV)
        bad = [(n, tuple(x.shape), w) for n, x, w in (
            ("q", q, (B, T, hq, info.K)), ("k", k, (B, T, hq, info.K)), ("v", v, (B, T, info.HV, info.V)),
            ("g", g, g_want), ("beta", beta, (B, T, info.HV))) if tuple(x.shape) != w]
        if bad or hq not in (info.H, info.HV):
            raise HFError("%s (layer %d): shapes %s, expected q, k [B, T, H or HV, K], v [B, T, HV, V], g %s, "
                          "beta [B, T, HV] for %s" % (
                              name, layer_id, ", ".join("%s %s" % (n, list(s)) for n, s, _ in bad) or
                              "q %s" % list(q.shape), "[B, T, HV, K]" if info.arch == "kda" else "[B, T, HV]",
                              info.describe()))
        return B, T, hq

    def _check_qk_repeat(self, q, k):
        """Once per model: q/k given with HV heads are a repeat_interleave of H heads."""
        info = self._info
        r = info.HV // info.H
        for n, x in (("q", q), ("k", k)):
            base = x[:, :, ::r]
            if not torch.equal(base.repeat_interleave(r, dim=2), x):
                raise HFError("%s reaches the kernel with %d heads that are not a repeat_interleave of %d "
                              "q/k heads; stepq.hf cannot recover the q/k heads" % (n, info.HV, info.H))
        info.qk_checked = True

    def _prefill(self, layer_id, call):
        name = call.name
        q, k, v, g, beta = (call.get(x) for x in ("q", "k", "v", "g", "beta"))
        B, T, hq = self._check_inputs(layer_id, name, q, k, v, g, beta)
        info = self._info
        if hq != info.H and not info.qk_checked:
            self._check_qk_repeat(q, k)
        self._ensure_rows(B, name)
        li = info.index[layer_id]
        init = call.get("initial_state")
        if init is not None:
            if not self._is_placeholder(init):
                raise HFError("%s (layer %d): initial_state is a %s tensor %s, not stepq.hf's placeholder: the "
                              "cache's recurrent state did not come from this StepqCache"
                              % (name, layer_id, init.dtype, list(init.shape)))
            call.set("initial_state", self._unpack(li))
        call.set("output_final_state", True)
        out = call.run()
        if not isinstance(out, tuple) or len(out) != 2 or out[1] is None:
            raise HFError("%s (layer %d) returned %s, expected (output, final state)"
                          % (name, layer_id, type(out).__name__))
        o, final = out
        HV, K, V = info.HV, info.K, info.V
        if tuple(final.shape) != (B, HV, K, V):
            raise HFError("%s (layer %d) returned a final state of shape %s, expected [B, HV, K, V] = %s"
                          % (name, layer_id, list(final.shape), [B, HV, K, V]))
        if final.dtype not in (torch.float32, torch.bfloat16):
            final = final.float()
        final = final.contiguous()
        for pool, r0, r1, ids in self._segs:
            pool.pack(li, ids, final[r0:r1])
        self.kernel_calls["prefill"] += 1
        return o, self._placeholder

    def _unpack(self, li):
        info = self._info
        dense = torch.empty((len(self._rows), info.HV, info.K, info.V), dtype=torch.float32,
                            device=info.device)
        for pool, r0, r1, ids in self._segs:
            pool.unpack(li, ids, dense[r0:r1])
        return dense

    def _is_placeholder(self, t):
        return hasattr(t, "dim") and t.dim() == 2 and t.shape[-1] == 0

    def _decode(self, layer_id, call):
        name = call.name
        q, k, v, g, beta = (call.get(x) for x in ("q", "k", "v", "g", "beta"))
        init = call.get("initial_state")
        if init is None or not self._is_placeholder(init):
            raise HFError("%s (layer %d): a decode step without stepq.hf's placeholder as initial_state (got %s): "
                          "the layer did not read its state from this StepqCache"
                          % (name, layer_id, "None" if init is None else "a %s tensor %s"
                             % (init.dtype, list(init.shape))))
        info = self._info
        B, T, _ = self._check_inputs(layer_id, name, q, k, v, g, beta)
        if T != 1 or B != len(self._rows):
            raise HFError("%s (layer %d): q %s, expected [%d rows, 1 token, heads, K]"
                          % (name, layer_id, list(q.shape), len(self._rows)))
        q1, k1 = q[:, 0], k[:, 0]
        if q1.shape[1] != info.H:
            r = info.HV // info.H
            q1, k1 = q1[:, ::r], k1[:, ::r]
        q1, k1 = _f32_rows(q1), _f32_rows(k1)
        v1, g1, b1 = _f32_rows(v[:, 0]), _f32_rows(g[:, 0]), _f32_rows(beta[:, 0])
        out = torch.empty((B, info.HV, info.V), dtype=torch.float32, device=q.device)
        li = info.index[layer_id]
        l2 = bool(call.get("l2norm", False))
        scale = call.get("scale")
        for pool, r0, r1, ids in self._segs:
            if r0 == 0 and r1 == B:
                pool.decode(li, q1, k1, v1, g1, b1, cache_indices=ids, out=out, l2norm=l2, scale=scale)
            else:
                pool.decode(li, q1[r0:r1], k1[r0:r1], v1[r0:r1], g1[r0:r1], b1[r0:r1], cache_indices=ids,
                            out=out[r0:r1], l2norm=l2, scale=scale)
        self.kernel_calls["decode"] += 1
        return out.unsqueeze(1).to(q.dtype), self._placeholder

    # --- the transformers Cache interface ---------------------------------

    def update_recurrent_state(self, recurrent_states, layer_idx, *args, **kwargs):
        if layer_idx in self._info.index:
            if recurrent_states is not self._placeholder:
                raise HFError("layer %d stored a recurrent state %s in a StepqCache: its kernel call did not go "
                              "through stepq.hf (a model other than the cache's %s, or transformers %s calls a "
                              "kernel hf_names does not list)" % (layer_idx, getattr(recurrent_states, "shape", None),
                                                                  self._info.model_name, transformers.__version__))
        return DynamicCache.update_recurrent_state(self, recurrent_states, layer_idx, *args, **kwargs)

    @property
    def is_compileable(self):
        return False  # the hooks call a C library through ctypes

    def reorder_cache(self, beam_idx):
        raise HFError("StepqCache does not reorder rows for beam search (num_beams must be 1); a scheduler "
                      "uses select_rows()")

    def batch_repeat_interleave(self, repeats):
        raise HFError("StepqCache cannot repeat rows (num_return_sequences and num_beams must be 1)")

    def batch_select_indices(self, indices):
        raise HFError("StepqCache: use select_rows() (slots follow the rows)")

    def crop(self, max_length):
        raise HFError("StepqCache cannot be cropped (assisted / speculative decoding is not supported)")

    def __repr__(self):
        return "StepqCache(%d rows, slots %s)" % (len(self._rows), self.slots)


def _clone_layer(layer):
    """A copy of a cache layer with its own tensors (dicts and lists of
    tensors included); flags and sizes copied."""
    new = copy.copy(layer)
    for name, val in vars(layer).items():
        if isinstance(val, torch.Tensor):
            setattr(new, name, val.clone())
        elif isinstance(val, dict):
            setattr(new, name, {k: (x.clone() if isinstance(x, torch.Tensor) else copy.copy(x))
                                for k, x in val.items()})
        elif isinstance(val, list):
            setattr(new, name, [x.clone() if isinstance(x, torch.Tensor) else copy.copy(x) for x in val])
    return new


_LINEAR_STATE_DICTS = ("conv_states", "recurrent_states")


def _has_kv(layer):
    """An attention cache layer (keys and values), as DynamicLayer."""
    return hasattr(layer, "keys") and hasattr(layer, "values")


def _kv_length(layers):
    """The positions the attention layers hold (one length for all of them, after a prefill)."""
    lengths = {i: layer.keys.shape[-2] for i, layer in enumerate(layers)
               if _has_kv(layer) and isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4}
    if len(set(lengths.values())) != 1:
        raise HFError("extend_rows: attention layers hold %s positions (layer: length); one length after a "
                      "prefill expected" % (lengths or "no"))
    return next(iter(lengths.values()))


def _set_batch_size(layers, B):
    """Layers that keep their batch size as an int (some releases' linear-attention layers) follow
    the rows."""
    for layer in layers:
        if isinstance(getattr(layer, "batch_size", None), int) and not isinstance(layer.batch_size, bool):
            layer.batch_size = B


def _cat_layer(i, a, b, pad_a, pad_b):
    """Concatenates layer b's rows after layer a's, in place in a."""
    known = set()
    if isinstance(a, LinearAttentionCacheLayerMixin):
        for name in _LINEAR_STATE_DICTS:
            da, db = getattr(a, name), getattr(b, name)
            for key in da:
                x, y = da[key], db.get(key)
                if x is None and y is None:
                    continue
                if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                    raise HFError("extend_rows: layer %d %s[%r] is set on one side only (rows at different "
                                  "stages: run both prefills first)" % (i, name, key))
                da[key] = torch.cat([x, y], dim=0)
            known.add(name)
        if getattr(a, "has_previous_state", None) != getattr(b, "has_previous_state", None):
            raise HFError("extend_rows: layer %d: has_previous_state %s and %s"
                          % (i, a.has_previous_state, b.has_previous_state))
    if _has_kv(a):
        if getattr(a, "is_sliding", False):
            raise HFError("extend_rows: layer %d is a sliding-window layer (%s)" % (i, type(a).__name__))
        for name in ("keys", "values"):
            x, y = getattr(a, name), getattr(b, name)
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.dim() != 4 or y.dim() != 4:
                raise HFError("extend_rows: layer %d (%s) %s is not a [B, heads, T, D] tensor on both sides"
                              % (i, type(a).__name__, name))
            x = F.pad(x, (0, 0, pad_a, 0)) if pad_a else x
            y = F.pad(y, (0, 0, pad_b, 0)) if pad_b else y
            setattr(a, name, torch.cat([x, y], dim=0))
            known.add(name)
    for name, val in vars(a).items():
        if name in known:
            continue
        if isinstance(val, torch.Tensor) or isinstance(val, dict) and any(
                isinstance(x, torch.Tensor) for x in val.values()):
            raise HFError("extend_rows: layer %d (%s) holds tensors in %r that stepq.hf does not know how to "
                          "concatenate" % (i, type(a).__name__, name))
