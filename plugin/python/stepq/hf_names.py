"""Where a transformers checkpoint keeps what stepq needs, as names, in one place.

stepq.hf (the transformers cache), tools/scripts/capture_traces.py and
tools/scripts/nll_eval.py reach a hybrid model's recurrent kernels by
name: the config fields that give the state's shape, the linear-attention
layer classes, and the module-level kernel functions the layers call by name
(so replacing the module attribute routes a call through a wrapper; a forward
pre-hook on each layer says which layer is running). transformers renames
these between releases, so every name a release has used is listed here, and
a miss says exactly what was looked for (tests/tools/check_hf_names.py runs
that on the GPU host against the installed transformers and the tiny models).

This module imports nothing of stepq (and torch only inside wrap_kernels), so
the scripts load it by path (tools/scripts/hf_names.py) without the library.
A name that is not found raises HFNamesError (a LookupError) saying what was
looked for.

Seen in transformers 5.17 (on the GPU host):
  Qwen3.5 / Qwen3-Next GDN: config linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim; layer *GatedDeltaNet; kernels
    torch_chunk_gated_delta_rule (prefill), torch_recurrent_gated_delta_rule (decode);
    q and k reach the kernel repeated to the value heads.
  Kimi-Linear KDA: config linear_num_heads, linear_head_dim (q, k and v heads
    equal, K = V); layer KimiLinearDeltaAttention; kernels
    chunk_kimi_delta_attention (prefill), recurrent_kimi_delta_attention (decode);
    the gate g reaches the kernel as log decay per key channel [B, T, HV, K]
    (-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), A_log [1,1,HV,1],
    dt_bias [HV*K]) and beta = sigmoid(b) [B, T, HV].
  Both: kernels take (q, k, v, g=, beta=, initial_state=, output_final_state=,
    use_qk_l2norm_in_kernel=True) and return (o, state [B, HV, K, V] fp32); the
    cache keeps the state at past_key_values.layers[L].recurrent_states[0].
Older releases: Kimi-Linear config linear_attn_{key,value}_heads and
linear_attn_{key,value}_head_dim, kernels torch_chunk_kda / torch_recurrent_kda;
layers holding the kernels as instance attributes (chunk_gated_delta_rule, ...).
"""



class HFNamesError(LookupError):
    """A name stepq looks for in transformers (a config field, a layer class,
    a kernel function) is not there; the message lists what was looked for."""


# (arch, (H field, HV field, K field, V field)); the first set the config has wins.
SHAPE_FIELDS = (
    ("gdn", ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")),
    ("kda", ("linear_num_heads", "linear_num_heads", "linear_head_dim", "linear_head_dim")),
    ("kda", ("linear_attn_key_heads", "linear_attn_value_heads", "linear_attn_key_head_dim",
             "linear_attn_value_head_dim")),
)

# Layer classes with a recurrent state: a class name containing one of these.
LAYER_MARKERS = ("GatedDeltaNet", "DeltaAttention", "KDA")

# Module-level kernel functions, per arch: (prefill names, decode names).
KERNELS = {
    "gdn": (("torch_chunk_gated_delta_rule",), ("torch_recurrent_gated_delta_rule",)),
    "kda": (("chunk_kimi_delta_attention", "torch_chunk_kda"),
            ("recurrent_kimi_delta_attention", "torch_recurrent_kda")),
}
# Instance attributes some releases call instead (wrapped where they are plain functions).
LAYER_ATTRS = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule", "chunk_kda", "recurrent_kda")
# Which of them is the prefill (chunk) kernel and which the one-token decode kernel.
LAYER_ATTR_ROLES = {"chunk_gated_delta_rule": "prefill", "recurrent_gated_delta_rule": "decode",
                    "chunk_kda": "prefill", "recurrent_kda": "decode"}

# transformers modules that define the layers, for the installed-names check.
MODULES = {
    "gdn": ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_next.modeling_qwen3_next"),
    "kda": ("transformers.models.kimi_linear.modeling_kimi_linear",),
}


def text_config(cfg):
    if hasattr(cfg, "get_text_config"):
        return cfg.get_text_config()
    return getattr(cfg, "text_config", None) or cfg


def model_shape(cfg):
    """(arch, H, HV, K, V) from a transformers config; HFNamesError naming every field set looked for."""
    c = text_config(cfg)
    for arch, fields in SHAPE_FIELDS:
        if all(hasattr(c, f) for f in fields):
            return (arch,) + tuple(int(getattr(c, f)) for f in fields)
    want = "; ".join("%s: %s" % (arch, ", ".join(f)) for arch, f in SHAPE_FIELDS)
    raise HFNamesError("%s has none of the linear-attention field sets (%s); its fields with 'linear' or 'head': %s"
                       % (type(c).__name__, want,
                          ", ".join(sorted(k for k in vars(c) if "linear" in k or "head" in k)) or "none"))


def recurrent_layers(model):
    """[(layer_idx, module)] of the layers with a recurrent state, and the set of their modules' names."""
    layers, mods = [], set()
    for _, m in model.named_modules():
        cls = type(m).__name__
        if hasattr(m, "layer_idx") and any(k in cls for k in LAYER_MARKERS):
            layers.append((m.layer_idx, m))
            mods.add(type(m).__module__)
    if not layers:
        raise HFNamesError("%s has no module with layer_idx whose class name contains one of %s"
                           % (type(model).__name__, ", ".join(LAYER_MARKERS)))
    return sorted(layers, key=lambda x: x[0]), mods


def all_kernel_names():
    return tuple(n for pre, dec in KERNELS.values() for n in pre + dec)


def kernel_role(name):
    """"prefill" or "decode" for a kernel name of KERNELS or LAYER_ATTRS (as wrap_kernels passes
    it to wrap); HFNamesError for any other name."""
    for pre, dec in KERNELS.values():
        if name in pre:
            return "prefill"
        if name in dec:
            return "decode"
    if name in LAYER_ATTR_ROLES:
        return LAYER_ATTR_ROLES[name]
    raise HFNamesError("%s is neither a prefill nor a decode kernel name (known: %s, %s)"
                       % (name, ", ".join(all_kernel_names()), ", ".join(LAYER_ATTRS)))


def wrap_kernels(layers, mods, wrap, marker):
    """Replaces every kernel function found (module level, then plain-function layer attributes)
    with wrap(fn, name); fn.<marker> marks a wrapped one so nothing is wrapped twice.
    Returns the list of what was wrapped; HFNamesError naming what was looked for if nothing."""
    import importlib
    import torch
    patched = []
    for modname in sorted(mods):
        mod = importlib.import_module(modname)
        for kn in all_kernel_names():
            f = getattr(mod, kn, None)
            if callable(f) and not getattr(f, marker, False):
                setattr(mod, kn, wrap(f, kn))
                patched.append(modname.rsplit(".", 1)[-1] + "." + kn)
    for L, m in layers:
        for an in LAYER_ATTRS:
            f = getattr(m, an, None)
            # A submodule cannot be replaced by a function (torch refuses it).
            if callable(f) and not isinstance(f, torch.nn.Module) and not getattr(f, marker, False):
                setattr(m, an, wrap(f, an))
                patched.append("layer%d.%s" % (L, an))
    if not patched:
        raise HFNamesError("found no recurrent kernel to wrap: looked for the functions %s in %s and the layer "
                           "attributes %s" % (", ".join(all_kernel_names()), ", ".join(sorted(mods)),
                                              ", ".join(LAYER_ATTRS)))
    return patched


def cache_state(cache, L):
    """The recurrent state the cache keeps for layer L (transformers 5.x: layers[L].recurrent_states[0])."""
    try:
        return cache.layers[L].recurrent_states[0]
    except (AttributeError, IndexError, KeyError, TypeError):
        pass
    try:
        return cache.recurrent_states[L]  # older hybrid caches
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
