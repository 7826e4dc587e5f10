#!/usr/bin/env python3
"""Capture the recurrent-kernel inputs of a hybrid linear-attention model as safetensors traces.

Runs on the GPU host (torch + transformers). Loads a transformers checkpoint
(Qwen3.5 / Qwen3-Next Gated DeltaNet, Kimi-Linear KDA), cuts a text file into
segments, runs each segment through the model once (no cache: the prefill path)
and records, per linear-attention layer, exactly what the recurrent kernel is
handed: q, k, v, g (log-space decay), beta. Nothing is recomputed: the values
come from the call of the module-level kernel function (or the layer's
kernelised attribute), intercepted by a wrapper that records and then calls the
original.

Trace format (read by tools/calib/trace.c; see tools/CALIBRATION.md):
  safetensors: u64 little-endian header length, JSON header, raw data.
  tensors, per recorded layer L (global layer index):
    layer{L}.q    [S, T, Hq, K]   Hq = q/k head count (H) when recoverable, else HV
    layer{L}.k    [S, T, Hq, K]
    layer{L}.v    [S, T, HV, V]
    layer{L}.g    [S, T, HV]      GDN, log space, float32
                  [S, T, HV, K]   KDA (per key channel)
    layer{L}.beta [S, T, HV]
    layer{L}.o    [S, T, HV, V]   optional (--store-output): the kernel's output, for checks
  __metadata__ (all strings): format "stepq-trace", version "1", arch gdn|kda,
    H, HV, K, V, layers (comma list of the layers in THIS file), all_layers,
    qk_l2norm "1" when q/k are stored BEFORE the in-kernel l2norm (the replay
    must normalise), scale (q scale applied in-kernel after the l2norm),
    stream_offset, n_streams (in this file), streams_total, seq_len,
    source, split, segment_offsets (JSON list of byte offsets, this file's
    streams), tokenizer, model, dtype, capture tool versions.
  A capture may be split over several files (--max-file-bytes): by streams
  first and, when one stream does not fit, by layers; every file is
  self-describing and the C reader joins them by (stream_offset, layer).

Tokens: byte-level models (vocab 256) use id = byte value (--tokenizer byte,
the default when the config's vocab_size is 256); otherwise the checkpoint's
tokenizer is used and a segment is seq_len tokens.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_names  # noqa: E402

DTYPE_NAMES = {"bf16": "BF16", "fp32": "F32", "fp16": "F16"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="transformers checkpoint directory")
    p.add_argument("--text", required=True, help="text file to cut into segments")
    p.add_argument("--split", default=None, help="label stored in the metadata (valid, test, ...)")
    p.add_argument("--segments", type=int, default=32, help="number of segments (streams); default 32")
    p.add_argument("--seg-len", type=int, default=2048, help="tokens per segment; default 2048")
    p.add_argument("--offset", type=int, default=0, help="byte offset of the first segment")
    p.add_argument("--stride", type=int, default=0,
                   help="bytes between segment starts (0: seg-len, i.e. consecutive)")
    p.add_argument("--out", required=True, help="output prefix: PREFIX-000.safetensors, ...")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default="bf16",
                   help="storage dtype of q, k, v, beta, o (g is always float32); default bf16 "
                        "(lossless for a bf16 model)")
    p.add_argument("--model-dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=8, help="segments per forward pass")
    p.add_argument("--max-file-bytes", type=int, default=1 << 40,
                   help="split the capture so no file exceeds this many bytes")
    p.add_argument("--layers", default="all", help="comma list of global layer ids, or all")
    p.add_argument("--store-output", action="store_true", help="also store the kernel output o")
    p.add_argument("--tokenizer", choices=["auto", "byte", "model"], default="auto")
    p.add_argument("--check", action="store_true",
                   help="replay stream 0 of every layer token by token in fp32 from the stored "
                        "(rounded) inputs and report the relative error against the kernel output")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- segments

def make_segments(text_path, n, seg_len, offset=0, stride=0, tokenizer=None):
    """Returns (list of token-id lists, list of byte offsets). Byte tokenizer when tokenizer is None."""
    with open(text_path, "rb") as f:
        data = f.read()
    stride = stride or seg_len
    segs, offs = [], []
    if tokenizer is None:
        for i in range(n):
            o = offset + i * stride
            if o + seg_len > len(data):
                raise SystemExit("capture: %s has %d bytes; segment %d needs [%d, %d)"
                                 % (text_path, len(data), i, o, o + seg_len))
            segs.append(list(data[o:o + seg_len]))
            offs.append(o)
        return segs, offs
    ids = tokenizer(data.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
    for i in range(n):
        o = offset + i * stride
        if o + seg_len > len(ids):
            raise SystemExit("capture: %s has %d tokens; segment %d needs [%d, %d)"
                             % (text_path, len(ids), i, o, o + seg_len))
        segs.append(ids[o:o + seg_len])
        offs.append(o)
    return segs, offs


# ----------------------------------------------------------------------------- safetensors writer

def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, torch.Tensor on CPU, contiguous). Writes contiguous, 8-byte aligned header."""
    import torch
    st_dtype = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    off = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": st_dtype[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for _, t in tensors:
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)
    return 8 + len(hj) + off


# ----------------------------------------------------------------------------- hooks

class Recorder:
    """Wraps the recurrent kernels; a forward pre-hook on each linear-attention layer says which layer runs."""

    def __init__(self, keep_output, layers):
        self.current = None
        self.keep_output = keep_output
        self.layers = layers  # None: all
        self.records = {}     # layer -> list of dicts (one per forward batch)
        self.calls = 0

    def wrap(self, fn):
        rec = self

        def wrapped(query, key, value, g, beta, *args, **kwargs):
            out = fn(query, key, value, g, beta, *args, **kwargs)
            L = rec.current
            if L is None:
                raise RuntimeError("capture: recurrent kernel called outside a hooked layer")
            if rec.layers is None or L in rec.layers:
                l2 = kwargs.get("use_qk_l2norm_in_kernel", False)
                r = {"q": query.detach(), "k": key.detach(), "v": value.detach(),
                     "g": g.detach(), "beta": beta.detach(), "l2norm": bool(l2),
                     "init": kwargs.get("initial_state", None) is not None}
                if rec.keep_output:
                    r["o"] = out[0].detach()
                rec.records.setdefault(L, []).append({k: (x.cpu() if hasattr(x, "cpu") else x)
                                                      for k, x in r.items()})
                rec.calls += 1
            return out
        wrapped.__wrapped_stepq__ = fn
        return wrapped


def install_hooks(model, rec):
    """Wraps the model's recurrent kernels (names: hf_names.py) and hooks every recurrent layer."""
    try:
        layers, mods = hf_names.recurrent_layers(model)
        patched = hf_names.wrap_kernels(layers, mods, lambda f, name: rec.wrap(f), "__wrapped_stepq__")
    except hf_names.HFNamesError as e:
        raise SystemExit("capture: %s" % e)
    for L, m in layers:
        def pre(module, args, kwargs, L=L):
            rec.current = L
        m.register_forward_pre_hook(pre, with_kwargs=True)

        def post(module, args, out, L=L):
            rec.current = None
        m.register_forward_hook(post)
    return [L for L, _ in layers], patched


def model_shape(cfg):
    """(arch, H, HV, K, V) from a transformers config (field names: hf_names.py)."""
    try:
        return hf_names.model_shape(cfg)
    except hf_names.HFNamesError as e:
        raise SystemExit("capture: %s" % e)


def dedup_qk(x, H, HV):
    """x [B,T,Hx,K]: returns ([B,T,H,K], 'H') when the heads are an exact repeat_interleave of H heads."""
    import torch
    if x.shape[2] == H:
        return x, "H"
    if x.shape[2] == HV and HV % H == 0:
        rep = HV // H
        base = x[:, :, ::rep]
        if torch.equal(base.repeat_interleave(rep, dim=2), x):
            return base.contiguous(), "H"
    return x, "HV"


def replay_check(q, k, v, g, beta, o, l2norm, kda):
    """fp32 token-by-token recurrence (as kernels/dsp.h writes it) on one stream; returns rel. error vs o."""
    import torch
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))  # [T,Hq,K] ... [T,HV]
    T, HV, V = v.shape
    Hq, K = q.shape[1], q.shape[2]
    rep = HV // Hq
    q = q.repeat_interleave(rep, dim=1)
    k = k.repeat_interleave(rep, dim=1)
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / math.sqrt(K)
    S = torch.zeros(HV, K, V)
    out = torch.zeros(T, HV, V)
    for t in range(T):
        if kda:
            S = S * g[t].exp().unsqueeze(-1)
        else:
            S = S * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    ref = o.float()
    return float(((out - ref) ** 2).sum() / (ref ** 2).sum().clamp_min(1e-30))


# ----------------------------------------------------------------------------- main

def main(argv=None):
    a = parse_args(argv)
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(a.model)
    arch, H, HV, K, V = model_shape(cfg)
    vocab = getattr(getattr(cfg, "text_config", None) or cfg, "vocab_size", 0)
    tok_kind = a.tokenizer if a.tokenizer != "auto" else ("byte" if vocab == 256 else "model")
    tokenizer = None
    if tok_kind == "model":
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(a.model)
    segs, offs = make_segments(a.text, a.segments, a.seg_len, a.offset, a.stride, tokenizer)

    mdt = torch.bfloat16 if a.model_dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=mdt).to(a.device).eval()
    want = None if a.layers == "all" else set(int(x) for x in a.layers.split(","))
    rec = Recorder(a.store_output or a.check, want)
    lin_layers, patched = install_hooks(model, rec)
    layers = [L for L in lin_layers if want is None or L in want]
    print("capture: %s arch=%s H=%d HV=%d K=%d V=%d layers=%s" % (a.model, arch, H, HV, K, V, layers),
          file=sys.stderr)
    print("capture: wrapped %s" % ", ".join(patched), file=sys.stderr)

    t0 = time.time()
    with torch.no_grad():
        for b0 in range(0, len(segs), a.batch):
            ids = torch.tensor(segs[b0:b0 + a.batch], dtype=torch.long, device=a.device)
            model(input_ids=ids, use_cache=False)
    torch.cuda.synchronize() if a.device.startswith("cuda") else None
    print("capture: %d segments x %d tokens in %.1f s (%d kernel calls)"
          % (len(segs), a.seg_len, time.time() - t0, rec.calls), file=sys.stderr)

    sdt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[a.dtype]
    per_layer = {}
    qk_heads = None
    l2 = None
    for L in layers:
        rs = rec.records.get(L)
        if not rs:
            raise SystemExit("capture: layer %d recorded nothing" % L)
        if any(r["init"] for r in rs):
            raise SystemExit("capture: layer %d ran with an initial state; expected prefill" % L)
        d = {}
        for name in ("q", "k", "v", "g", "beta") + (("o",) if rec.keep_output else ()):
            d[name] = torch.cat([r[name] for r in rs], dim=0)
        d["q"], kq = dedup_qk(d["q"], H, HV)
        d["k"], kk = dedup_qk(d["k"], H, HV)
        if kq != kk:
            raise SystemExit("capture: q and k head counts differ after de-duplication")
        qk_heads = kq
        l2 = rs[0]["l2norm"]
        for name in d:
            d[name] = d[name].to(torch.float32 if name == "g" else sdt).contiguous()
        exp_g = (len(segs), a.seg_len, HV, K) if arch == "kda" else (len(segs), a.seg_len, HV)
        if tuple(d["g"].shape) != exp_g:
            raise SystemExit("capture: layer %d g has shape %s, expected %s"
                             % (L, tuple(d["g"].shape), exp_g))
        per_layer[L] = d

    if a.check:
        for L in layers:
            d = per_layer[L]
            e = replay_check(d["q"][0], d["k"][0], d["v"][0], d["g"][0], d["beta"][0], d["o"][0], l2,
                             arch == "kda")
            print("capture: check layer %d stream 0: fp32 replay vs kernel output, rel. sq. error %.3e"
                  % (L, e), file=sys.stderr)

    # split into files: streams first, then layers
    names = ("q", "k", "v", "g", "beta") + (("o",) if a.store_output else ())
    per_stream_layer = {L: sum(per_layer[L][n][0].numel() * per_layer[L][n].element_size() for n in names)
                        for L in layers}
    per_stream = sum(per_stream_layer.values())
    budget = a.max_file_bytes - 65536  # header allowance
    groups = []  # (s0, s1, [layers])
    S = len(segs)
    if per_stream <= budget:
        spf = max(1, budget // per_stream)
        for s0 in range(0, S, spf):
            groups.append((s0, min(S, s0 + spf), layers))
    else:
        for s0 in range(S):
            cur, size = [], 0
            for L in layers:
                if cur and size + per_stream_layer[L] > budget:
                    groups.append((s0, s0 + 1, cur))
                    cur, size = [], 0
                if per_stream_layer[L] > budget:
                    raise SystemExit("capture: one stream of layer %d is %d bytes > --max-file-bytes"
                                     % (L, per_stream_layer[L]))
                cur.append(L)
                size += per_stream_layer[L]
            groups.append((s0, s0 + 1, cur))

    base_meta = {
        "format": "stepq-trace", "version": "1", "arch": arch, "H": H, "HV": HV, "K": K, "V": V,
        "qk_heads": qk_heads, "qk_l2norm": "1" if l2 else "0", "scale": repr(K ** -0.5),
        "all_layers": ",".join(str(L) for L in layers), "streams_total": S, "seq_len": a.seg_len,
        "source": os.path.basename(a.text), "split": a.split or os.path.basename(a.text),
        "tokenizer": tok_kind, "model": os.path.basename(os.path.normpath(a.model)),
        "model_dtype": a.model_dtype, "dtype": a.dtype,
        "tool": "capture_traces.py torch %s transformers %s" % (torch.__version__, transformers.__version__),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    total = 0
    for i, (s0, s1, ls) in enumerate(groups):
        meta = dict(base_meta)
        meta.update({"stream_offset": s0, "n_streams": s1 - s0, "layers": ",".join(str(L) for L in ls),
                     "segment_offsets": json.dumps(offs[s0:s1])})
        tensors = []
        for L in ls:
            for n in names:
                tensors.append(("layer%d.%s" % (L, n), per_layer[L][n][s0:s1].contiguous()))
        path = "%s-%03d.safetensors" % (a.out, i)
        nb = write_safetensors(path, tensors, meta)
        total += nb
        print("capture: wrote %s (%d bytes, streams %d..%d, layers %s)" % (path, nb, s0, s1 - 1, meta["layers"]),
              file=sys.stderr)
    print("capture: %d files, %d bytes" % (len(groups), total), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
