#!/usr/bin/env python3
"""Excess NLL of a GDN checkpoint with its recurrent state stored through precision maps.

Runs on the GPU host (torch + transformers). Teacher-forced: each stream is
prefill P bytes (the native chunk kernel; the boundary state is then stored
once through the method), then D decode steps; after every recurrent update
the new state is stored through the method (quantize + reconstruct, the C
reference quantizers of libstepq via the ctypes shim
build*/tools/libstepq_replay_shim.so) and the output of that step is the one
computed before storage (paper Eq. 4), exactly as transformers' decode path
returns it. Reported: NLL per byte of the D decode predictions (bytes
P+1..P+D) and the excess over the fp32 state, mean and standard error over
streams, also over the first and last 256 decode predictions.

Methods: fp32 (state untouched), bf16 (state rounded to bf16 after every
step), and NAME=MAP.json for every map given with --map.
"""
import argparse
import ctypes
import json
import math
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True, help="evaluation text (WikiText-2 test)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=1536)
    p.add_argument("--offset", type=int, default=0, help="byte offset of the first stream")
    p.add_argument("--shim", required=True, help="path of libstepq_replay_shim.so")
    p.add_argument("--map", action="append", default=[], help="NAME=PATH (repeatable)")
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--model-dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--markdown", help="write a markdown table here")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="store states with the C reference on the CPU, or the library's CUDA pack/unpack "
                        "kernels (auto: CUDA when the shim has it and it agrees with the CPU path)")
    p.add_argument("--group", type=int, default=0,
                   help="methods per batched run besides fp32 (0: all in one batch)")
    return p.parse_args(argv)


def map_bits_per_value(path):
    """Compact bits per value of a GDN map (config/SCHEMA.md accounting)."""
    with open(path) as f:
        m = json.load(f)
    meth = m["method"]
    if meth in ("fp32", "bf16", "fp16"):
        return 32.0 if meth == "fp32" else 16.0
    md = m["model"]
    K, V = md["head_k_dim"], md["head_v_dim"]
    col = meth in ("dsq", "spatial", "stepq")
    bits = 0
    n = 0
    for layer in m["layers"]:
        for h in layer["heads"]:
            b = h["bits"]
            n += K * V
            if b == 16:
                bits += 16 * K * V
            else:
                bits += 8 * ((K * V * b + 7) // 8) + 16 * K + (16 * V if col else 0)
    return bits / n


class Shim:
    def __init__(self, path, threads):
        self.lib = ctypes.CDLL(path)
        self.lib.stepq_shim_last_error.restype = ctypes.c_char_p
        self.lib.stepq_shim_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
        self.lib.stepq_shim_layer_index.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.lib.stepq_shim_roundtrip.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        self.lib.stepq_shim_close.argtypes = [ctypes.c_void_p]
        self.lib.stepq_shim_cuda_open.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.lib.stepq_shim_cuda_roundtrip.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                        ctypes.c_int, ctypes.c_void_p]
        self.threads = threads

    def open(self, map_path):
        h = ctypes.c_void_p()
        if self.lib.stepq_shim_open(map_path.encode(), self.threads, ctypes.byref(h)) < 0:
            raise SystemExit("nll_eval: %s: %s" % (map_path, self.lib.stepq_shim_last_error().decode()))
        return h

    def layer_index(self, h, L):
        li = self.lib.stepq_shim_layer_index(h, L)
        if li < 0:
            raise SystemExit("nll_eval: layer %d is not in the map" % L)
        return li

    def cuda_open(self, h, max_n):
        """0 when the CUDA pack/unpack path is usable for this map, else the error text."""
        if self.lib.stepq_shim_cuda_open(h, max_n) < 0:
            return self.lib.stepq_shim_last_error().decode()
        return 0

    def cuda_roundtrip(self, h, li, dev_states, stream):
        n = dev_states.shape[0]
        if self.lib.stepq_shim_cuda_roundtrip(h, li, ctypes.c_void_p(dev_states.data_ptr()), n,
                                              ctypes.c_void_p(stream)) < 0:
            raise SystemExit("nll_eval: CUDA roundtrip: %s" % self.lib.stepq_shim_last_error().decode())

    def roundtrip(self, h, li, cpu_states):
        n = cpu_states.shape[0]
        if self.lib.stepq_shim_roundtrip(h, li, ctypes.c_void_p(cpu_states.data_ptr()), n) < 0:
            raise SystemExit("nll_eval: roundtrip: %s" % self.lib.stepq_shim_last_error().decode())


def main(argv=None):
    a = parse_args(argv)
    import importlib
    import torch
    from transformers import AutoModelForCausalLM

    seg = a.prefill + a.decode + 1
    with open(a.text, "rb") as f:
        data = f.read()
    if a.offset + a.streams * seg > len(data):
        raise SystemExit("nll_eval: %s has %d bytes, need %d" % (a.text, len(data), a.offset + a.streams * seg))
    ids = torch.tensor([list(data[a.offset + i * seg:a.offset + (i + 1) * seg]) for i in range(a.streams)],
                       dtype=torch.long, device=a.device)

    mdt = torch.bfloat16 if a.model_dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=mdt).to(a.device).eval()

    # Route the recurrent kernels through a wrapper that stores the returned state.
    state = {"layer": None, "fn": None}
    mods, layers = set(), []
    for _, m in model.named_modules():
        if hasattr(m, "layer_idx") and "GatedDeltaNet" in type(m).__name__:
            layers.append(m)
            mods.add(type(m).__module__)
    if not layers:
        raise SystemExit("nll_eval: no GatedDeltaNet layers found")
    for m in layers:
        def pre(module, args, kwargs, L=m.layer_idx):
            state["layer"] = L
        m.register_forward_pre_hook(pre, with_kwargs=True)
    calls = {"n": 0}

    def wrap(fn):
        def wrapped(*args, **kwargs):
            out, st = fn(*args, **kwargs)
            if st is not None and state["fn"] is not None:
                st = state["fn"](st, state["layer"])
                calls["n"] += 1
            return out, st
        return wrapped
    for modname in mods:
        mod = importlib.import_module(modname)
        for kn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            if hasattr(mod, kn):
                setattr(mod, kn, wrap(getattr(mod, kn)))
    for m in layers:
        for an in ("chunk_gated_delta_rule", "recurrent_gated_delta_rule"):
            f = getattr(m, an, None)
            if callable(f):
                setattr(m, an, wrap(f))

    shim = Shim(a.shim, a.threads)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_state_shape = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    lin_layers = sorted(m.layer_idx for m in layers)
    backend_used = {}
    methods = [("fp32", None)] + ([] if a.no_bf16 else [("bf16", None)])
    for spec in a.map:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit("nll_eval: --map %s: expected NAME=PATH" % spec)
        methods.append((name, path))

    def make_fn(name, path):
        if name == "fp32" and path is None:
            return lambda st, L: st
        if name == "bf16" and path is None:
            return lambda st, L: st.to(torch.bfloat16).to(st.dtype)
        h = shim.open(path)
        cache, bufs = {}, {}
        use_cuda = False
        if a.backend != "cpu" and a.device.startswith("cuda"):
            err = shim.cuda_open(h, a.streams)
            if err == 0:
                # Check the CUDA path against the C reference on state-like data: the two must
                # agree to within 1% of the quantization error (codes may differ by a tie).
                import torch as _t
                g = _t.Generator(device="cpu").manual_seed(1)
                HVKV = model_state_shape
                x = (_t.randn((a.streams,) + HVKV, generator=g) *
                     _t.exp(_t.randn((a.streams, HVKV[0], HVKV[1], 1), generator=g)) *
                     _t.exp(_t.randn((a.streams, HVKV[0], 1, HVKV[2]), generator=g)) * 0.1)
                li0 = shim.layer_index(h, lin_layers[0])
                ref = x.clone().contiguous()
                shim.roundtrip(h, li0, ref)
                dev = x.to(a.device).contiguous()
                shim.cuda_roundtrip(h, li0, dev, _t.cuda.current_stream().cuda_stream)
                _t.cuda.synchronize()
                got = dev.cpu()
                qerr = ((ref - x) ** 2).sum().item()
                diff = ((got - ref) ** 2).sum().item()
                ratio = diff / qerr if qerr > 0 else (0.0 if diff == 0 else float("inf"))
                use_cuda = ratio <= 1e-2
                print("nll_eval: %s: CUDA vs C reference, squared difference / quantization error = %.2e: %s"
                      % (name, ratio, "using CUDA" if use_cuda else "using the CPU reference"), file=sys.stderr)
            else:
                print("nll_eval: %s: CUDA path unavailable (%s); using the CPU reference" % (name, err),
                      file=sys.stderr)
            if a.backend == "cuda" and not use_cuda:
                raise SystemExit("nll_eval: --backend cuda: not usable for %s" % name)
        backend_used[name] = "cuda" if use_cuda else "cpu"
        if use_cuda:
            def fn_cuda(st, L):
                if L not in cache:
                    cache[L] = shim.layer_index(h, L)
                x = st.detach().to(torch.float32).contiguous().clone()
                shim.cuda_roundtrip(h, cache[L], x, torch.cuda.current_stream().cuda_stream)
                return x.to(st.dtype)
            return fn_cuda

        def fn(st, L):
            if L not in cache:
                cache[L] = shim.layer_index(h, L)
            key = tuple(st.shape)
            if key not in bufs:  # one pinned host buffer per shape, reused every step
                bufs[key] = torch.empty(key, dtype=torch.float32, pin_memory=st.is_cuda)
            cpu = bufs[key]
            cpu.copy_(st.detach())
            shim.roundtrip(h, cache[L], cpu)
            out = torch.empty_like(st)
            out.copy_(cpu)
            return out
        return fn

    # Methods run side by side in one batch (streams x methods): the tiny model's forward is
    # cheap and mostly launch overhead, so this is several times faster than one run per
    # method, and every method sees the same kernels (same batch size) as its fp32 reference.
    # fp32 is in every group; excess NLL is taken within the group.
    S = a.streams
    others = [m for m in methods if m[0] != "fp32"]
    G = a.group if a.group > 0 else max(1, len(others))
    groups = [[("fp32", None)] + others[i:i + G] for i in range(0, len(others), G)] or [[("fp32", None)]]
    results = {}
    for grp in groups:
        fns = [make_fn(name, path) for name, path in grp]
        Mg = len(grp)

        def group_fn(st, L, fns=fns):
            out = torch.empty_like(st)
            for m, fn in enumerate(fns):
                out[m * S:(m + 1) * S] = fn(st[m * S:(m + 1) * S], L)
            return out
        state["fn"] = group_fn
        calls["n"] = 0
        t0 = time.time()
        idg = ids.repeat(Mg, 1)
        nll = torch.zeros(Mg * S, a.decode, dtype=torch.float64)
        with torch.no_grad():
            out = model(input_ids=idg[:, :a.prefill], use_cache=True)
            cache = out.past_key_values
            for i in range(a.decode):
                p = a.prefill + i
                out = model(input_ids=idg[:, p:p + 1], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
                nll[:, i] = -lp.gather(1, idg[:, p + 1:p + 2]).squeeze(1).double().cpu()
        if calls["n"] == 0:
            raise SystemExit("nll_eval: the state hook never ran")
        dt = time.time() - t0
        ref = nll[0:S]
        for m, (name, path) in enumerate(grp):
            r = nll[m * S:(m + 1) * S]
            if name == "fp32" and name in results:
                continue
            results[name] = {"nll": r, "ref": ref, "path": path, "seconds": dt}
            print("nll_eval: %-16s mean NLL %.4f nats/byte, excess %+.5f" % (
                name, r.mean().item(), (r - ref).mean().item()), file=sys.stderr)
        print("nll_eval: group of %d methods x %d streams: %.0f s" % (Mg, S, dt), file=sys.stderr)

    def ms(x):
        m = sum(x) / len(x)
        se = math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x)) if len(x) > 1 else 0.0
        return m, se
    table = []
    for name, r in results.items():
        d = r["nll"] - r["ref"]
        e = ms(d.mean(dim=1).tolist())
        ef = ms(d[:, :256].mean(dim=1).tolist())
        el = ms(d[:, -256:].mean(dim=1).tolist())
        n = ms(r["nll"].mean(dim=1).tolist())
        bpv = 32.0 if name == "fp32" and r["path"] is None else 16.0 if name == "bf16" and r["path"] is None \
            else map_bits_per_value(r["path"])
        # Paired difference against stepq at the same nominal budget (per-stream differences, so
        # the stream-to-stream spread of the text cancels).
        vs, vs_m, vs_se = None, None, None
        if "@" in name and not name.startswith("stepq@"):
            ref_name = "stepq@" + name.rsplit("@", 1)[1]
            if ref_name in results:
                dd = (r["nll"] - results[ref_name]["nll"]).mean(dim=1).tolist()
                vs = ref_name
                vs_m, vs_se = ms(dd)
        table.append({"method": name, "map": r["path"], "bits_per_value": bpv, "nll": n[0], "nll_se": n[1],
                      "excess": e[0], "excess_se": e[1], "excess_first256": ef[0], "excess_first256_se": ef[1],
                      "excess_last256": el[0], "excess_last256_se": el[1], "seconds": r["seconds"],
                      "minus_stepq": vs_m, "minus_stepq_se": vs_se, "stepq_ref": vs})
    meta = {"model": a.model, "text": os.path.basename(a.text), "streams": S, "prefill": a.prefill,
            "decode": a.decode, "offset": a.offset, "model_dtype": a.model_dtype,
            "torch": torch.__version__, "backend": backend_used}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": table}, f, indent=1)
    lines = ["| method | bits/value | NLL (nats/byte) | excess NLL | s.e. | first 256 | last 256 | "
             "minus stepq (paired) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in table:
        pair = "%+.5f +- %.5f" % (t["minus_stepq"], t["minus_stepq_se"]) if t["stepq_ref"] else ""
        lines.append("| %s | %.3f | %.4f | %+.5f | %.5f | %+.5f | %+.5f | %s |" % (
            t["method"], t["bits_per_value"], t["nll"], t["excess"], t["excess_se"], t["excess_first256"],
            t["excess_last256"], pair))
    md = "\n".join(lines) + "\n\n%d streams of %s, prefill %d + %d decode bytes, teacher-forced; mean +- s.e. over " \
                            "streams; excess = NLL(method) - NLL(fp32 state).\n" % (S, meta["text"], a.prefill, a.decode)
    print(md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
