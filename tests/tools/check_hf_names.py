#!/usr/bin/env python3
"""The installed transformers still has every name capture_traces.py and nll_eval.py use.

plugin/python/stepq/hf_names.py (loaded through tools/scripts/hf_names.py)
lists, per architecture, the config fields of the state's shape, the
recurrent layer classes and the module-level kernel functions the layers
call. This test fails, naming what it looked for, when a
transformers release renames one of them:
  1. each transformers module of hf_names.MODULES defines at least one prefill
     and one decode kernel name of its arch;
  2. for every tiny model found (tiny-gdn, tiny-kda; in $STEPQ_MODELS, or
     shared/models or ../shared/models beside the source tree), the config gives
     a shape of the expected arch, the wrapped kernels see every recurrent layer
     once at prefill (no initial state) and once per decode step (with one), the
     state they return is [B, HV, K, V] fp32, and the cache keeps exactly it.
Exit 0 pass, 1 a name missing or a call not seen, 77 no torch/transformers
(meson's "skipped"; the names are only checkable where transformers is).
"""
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools", "scripts"))
import hf_names  # noqa: E402

EXPECT_ARCH = {"tiny-gdn": "gdn", "tiny-kda": "kda"}


def model_dirs():
    roots = [os.environ.get("STEPQ_MODELS", ""), os.path.join(ROOT, "shared", "models"),
             os.path.join(ROOT, "..", "shared", "models")]
    out = {}
    for r in roots:
        for name in EXPECT_ARCH:
            p = os.path.join(r, name) if r else ""
            if name not in out and p and os.path.isfile(os.path.join(p, "config.json")):
                out[name] = p
    return out


def check_modules(fail):
    for arch, modnames in hf_names.MODULES.items():
        pre, dec = hf_names.KERNELS[arch]
        for modname in modnames:
            try:
                mod = importlib.import_module(modname)
            except ImportError as e:
                fail("%s: cannot import (%s)" % (modname, e))
                continue
            for kind, names in (("prefill", pre), ("decode", dec)):
                if not any(callable(getattr(mod, n, None)) for n in names):
                    fail("%s: no %s kernel named %s" % (modname, kind, " or ".join(names)))
            print("ok   %s: %s" % (modname, ", ".join(n for n in pre + dec if hasattr(mod, n))))


def check_model(name, path, fail):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        arch, H, HV, K, V = hf_names.model_shape(AutoConfig.from_pretrained(path))
    except hf_names.HFNamesError as e:
        fail("%s: %s" % (name, e))
        return
    if arch != EXPECT_ARCH[name]:
        fail("%s: config reads as %s, expected %s" % (name, arch, EXPECT_ARCH[name]))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    try:
        layers, mods = hf_names.recurrent_layers(model)
    except hf_names.HFNamesError as e:
        fail("%s: %s" % (name, e))
        return
    seen = {"cur": None, "calls": []}

    def wrap(fn, kname):
        def wrapped(*args, **kwargs):
            out, st = fn(*args, **kwargs)
            seen["calls"].append((seen["cur"], kname, kwargs.get("initial_state") is not None, st))
            return out, st
        wrapped.__check_hf_names__ = True
        return wrapped
    try:
        patched = hf_names.wrap_kernels(layers, mods, wrap, "__check_hf_names__")
    except hf_names.HFNamesError as e:
        fail("%s: %s" % (name, e))
        return
    for L, m in layers:
        m.register_forward_pre_hook(lambda mod, args, L=L: seen.__setitem__("cur", L))
    ids = torch.tensor([list(b"The President said that the ")], device=dev)
    B, want_layers = 1, [L for L, _ in layers]
    with torch.no_grad():
        out = model(input_ids=ids[:, :16], use_cache=True)
        steps = [("prefill", False)]
        for t in range(16, 18):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(("decode", True))
    cache = out.past_key_values
    calls = seen["calls"]
    if len(calls) != len(steps) * len(want_layers):
        fail("%s: %d kernel calls for %d layers x %d forwards (wrapped %s; calls %s)"
             % (name, len(calls), len(want_layers), len(steps), patched, [(c[0], c[1]) for c in calls]))
        return
    for i, (kind, init) in enumerate(steps):
        for j, L in enumerate(want_layers):
            cl, kname, has_init, st = calls[i * len(want_layers) + j]
            if cl != L or has_init != init:
                fail("%s: %s call for layer %s: kernel %s, initial_state %s (expected layer %d, %s)"
                     % (name, kind, cl, kname, has_init, L, init))
            if st is None or tuple(st.shape) != (B, HV, K, V):
                fail("%s: %s layer %d: %s returned a state of shape %s, expected [B, HV, K, V] = %s"
                     % (name, kind, L, kname, None if st is None else tuple(st.shape), (B, HV, K, V)))
    for j, L in enumerate(want_layers):
        c = hf_names.cache_state(cache, L)
        last = calls[-len(want_layers) + j][3]
        if c is None:
            fail("%s: layer %d: no recurrent state at past_key_values.layers[L].recurrent_states[0]" % (name, L))
        elif c.dtype != torch.float32 or not torch.equal(c, last.to(c.dtype)):
            fail("%s: layer %d: the cache's state (%s) is not the kernel's last returned state" % (name, L, c.dtype))
    print("ok   %s: %s H=%d HV=%d K=%d V=%d, layers %s, kernels %s" % (
        name, arch, H, HV, K, V, want_layers, sorted({c[1] for c in calls})))


def main():
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        print("skipped: %s (the names are checked where transformers is installed)" % e)
        return 77
    print("transformers %s" % transformers.__version__)
    errors = []

    def fail(msg):
        errors.append(msg)
        print("FAIL " + msg)
    check_modules(fail)
    found = model_dirs()
    for name in EXPECT_ARCH:
        if name in found:
            check_model(name, found[name], fail)
        else:
            print("note %s: not found (set STEPQ_MODELS); its forward is not checked" % name)
    print("%d failures" % len(errors))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
