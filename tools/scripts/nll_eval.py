#!/usr/bin/env python3
"""Excess NLL of a GDN or KDA checkpoint with its recurrent state stored through precision maps.

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
step), NAME=MAP.json for every map given with --map, and fp32xG for every
--shrink G (the fp32 state multiplied by G after every step: extra forgetting
without quantization, the test of tools/CALIBRATION.md's reading of tiny-kda),
and bf16~1..bf16~N for --jitter N (each element of the state multiplied by
1 + e, e uniform in +-2^-22 and drawn afresh every step from a generator seeded
k, then rounded to bf16 as the bf16 method does: the same store after a
recurrence whose fp32 arithmetic differs in the last bits, as another kernel's
does; the spread of these rows around bf16, paired per stream, is how far two
equally valid implementations of a bf16 state drift apart in NLL).
"""
import argparse
import ctypes
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_names  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--text", help="evaluation text (WikiText-2 test)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=1536)
    p.add_argument("--offset", type=int, default=0, help="byte offset of the first stream")
    p.add_argument("--shim", required=True, help="path of libstepq_replay_shim.so")
    p.add_argument("--self-test", action="store_true",
                   help="check the shim, the maps given with --map (default: config/calibrated/tiny-gdn) "
                        "and the accounting with numpy alone (no torch, no model), then exit")
    p.add_argument("--map", action="append", default=[], help="NAME=PATH (repeatable)")
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--shrink", type=float, action="append", default=[], metavar="G",
                   help="analysis (repeatable): a method fp32xG whose fp32 state is multiplied by G "
                        "after every step, 0 < G < 1: the extra forgetting a shrinking quantizer "
                        "adds, without the quantization (tools/CALIBRATION.md)")
    p.add_argument("--jitter", type=int, default=0, metavar="N",
                   help="analysis: N methods bf16~1..bf16~N, the bf16 store of a state jittered by a few "
                        "fp32 ulps (1 + e, |e| <= 2^-22, fresh every step, seed k): the NLL spread of "
                        "equally valid bf16 implementations (served path against nll_eval)")
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
    p.add_argument("--row-split", type=float, default=None,
                   help="analysis: the dual-axis fits (dsq, spatial, stepq) of the C reference "
                        "use this row split in (0, 1] in place of each map's row_split "
                        "(default: the map's, 0.5 unless it says otherwise; kernels/quant.h); "
                        "needs --backend cpu (the override is the C reference's; the CUDA kernels fit with "
                        "each map's own split)")
    a = p.parse_args(argv)
    if a.row_split is not None:
        if not 0.0 < a.row_split <= 1.0:
            p.error("--row-split %g: outside (0, 1]" % a.row_split)
        if a.backend != "cpu":
            p.error("--row-split: the override reaches the C reference only (the CUDA kernels fit "
                    "with each map's row_split); give --backend cpu")
    if not a.self_test and (not a.model or not a.text):
        p.error("--model and --text are required (except with --self-test)")
    if a.streams < 1 or a.prefill < 1 or a.decode < 1 or a.offset < 0:
        p.error("--streams, --prefill, --decode must be >= 1 and --offset >= 0")
    for g in a.shrink:
        if not 0.0 < g < 1.0:
            p.error("--shrink %g: outside (0, 1)" % g)
    if not 0 <= a.jitter <= 16:
        p.error("--jitter %d: outside 0..16" % a.jitter)
    return a


JITTER = 2.0 ** -22  # the relative size of --jitter's perturbation: a few fp32 ulps


def jitter_name(k):
    """The method name of --jitter's k-th method (k = 1..N)."""
    return "bf16~%d" % k


def shrink_name(g):
    """The method name of --shrink G."""
    return "fp32x%g" % g


def _ptr(t):
    """Address of a torch tensor's or a numpy array's data."""
    return t.data_ptr() if hasattr(t, "data_ptr") else t.ctypes.data


def _check_states(t, shape, what):
    """The shim trusts n * HV * d_k * d_v contiguous floats: refuse anything else."""
    dt = str(t.dtype)
    if dt not in ("torch.float32", "float32"):
        raise SystemExit("nll_eval: %s: states are %s, need float32" % (what, dt))
    if tuple(t.shape[1:]) != tuple(shape) or len(t.shape) != 4:
        raise SystemExit("nll_eval: %s: states of shape %s, the map is for [n, %d, %d, %d]"
                         % (what, tuple(t.shape), *shape))
    contig = t.is_contiguous() if hasattr(t, "is_contiguous") else t.flags["C_CONTIGUOUS"]
    if not contig:
        raise SystemExit("nll_eval: %s: states are not contiguous" % what)


def ms(x):
    """Mean and its standard error (unbiased variance / n) of a list of per-stream values."""
    m = sum(x) / len(x)
    se = math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x)) if len(x) > 1 else 0.0
    return m, se


def text_streams(path, streams, prefill, decode, offset, who):
    """The evaluation streams as lists of byte values: stream i is the prefill + decode + 1 bytes at
    offset + i * (prefill + decode + 1) (consecutive, non-overlapping; the last byte is the target
    of the last decode prediction). SystemExit naming `who` when the file is too short."""
    seg = prefill + decode + 1
    with open(path, "rb") as f:
        data = f.read()
    if offset + streams * seg > len(data):
        raise SystemExit("%s: %s has %d bytes, need %d" % (who, path, len(data), offset + streams * seg))
    return [list(data[offset + i * seg:offset + (i + 1) * seg]) for i in range(streams)]


def _budget(name):
    """The nominal bits of a NAME@B method name (-1 when B is not a number)."""
    try:
        return float(name.rsplit("@", 1)[1])
    except (IndexError, ValueError):
        return -1.0


def excess_table(results, bits_per_value):
    """The result rows (one per method, in the order of results) from per-stream NLLs.

    results: method name -> {"nll": [S, D] per-byte NLL of the D decode predictions, "ref": the same of
    the fp32 state (paired: the same streams), "path": the map or None, "seconds"} (torch tensors);
    bits_per_value(name, path) gives the bits/value column. Means and standard errors are over the S
    streams of each stream's mean (ms); served_path.py builds its drift table with this too.
    """
    table = []
    for name, r in results.items():
        d = r["nll"] - r["ref"]
        e = ms(d.mean(dim=1).tolist())
        ef = ms(d[:, :256].mean(dim=1).tolist())
        el = ms(d[:, -256:].mean(dim=1).tolist())
        n = ms(r["nll"].mean(dim=1).tolist())
        bpv = bits_per_value(name, r["path"])
        # Paired difference against stepq (per-stream differences, so the stream-to-stream spread
        # of the text cancels): at the same nominal budget, else (fp8, bf16, uniform@8: no stepq of
        # that budget) against the largest stepq budget present; the row names which.
        vs, vs_m, vs_se = None, None, None
        ref_name = None
        if name != "fp32" and not name.startswith("stepq@"):
            same = "stepq@" + name.rsplit("@", 1)[1] if "@" in name else None
            stepqs = [n for n in results if n.startswith("stepq@")]
            ref_name = same if same in results else max(stepqs, key=_budget, default=None)
        if ref_name:
            dd = (r["nll"] - results[ref_name]["nll"]).mean(dim=1).tolist()
            vs = ref_name
            vs_m, vs_se = ms(dd)
        table.append({"method": name, "map": r["path"], "bits_per_value": bpv, "nll": n[0], "nll_se": n[1],
                      "excess": e[0], "excess_se": e[1], "excess_first256": ef[0], "excess_first256_se": ef[1],
                      "excess_last256": el[0], "excess_last256_se": el[1], "seconds": r["seconds"],
                      "minus_stepq": vs_m, "minus_stepq_se": vs_se, "stepq_ref": vs,
                      "excess_per_stream": d.mean(dim=1).tolist()})
    return table


def excess_markdown(table, streams, text, prefill, decode):
    """excess_table's rows as the markdown table (and its one-line legend) this script prints."""
    lines = ["| method | bits/value | NLL (nats/byte) | excess NLL | s.e. | first 256 | last 256 | "
             "minus stepq (paired) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in table:
        pair = "%+.5f +- %.5f" % (t["minus_stepq"], t["minus_stepq_se"]) if t["stepq_ref"] else ""
        if pair and ("@" not in t["method"] or t["method"].rsplit("@", 1)[1] != t["stepq_ref"].split("@", 1)[1]):
            pair += " (vs %s)" % t["stepq_ref"]
        lines.append("| %s | %.3f | %.4f | %+.5f | %.5f | %+.5f | %+.5f | %s |" % (
            t["method"], t["bits_per_value"], t["nll"], t["excess"], t["excess_se"], t["excess_first256"],
            t["excess_last256"], pair))
    return "\n".join(lines) + "\n\n%d streams of %s, prefill %d + %d decode bytes, teacher-forced; mean +- s.e. over " \
                               "streams; excess = NLL(method) - NLL(fp32 state).\n" % (streams, text, prefill, decode)


class Shim:
    def __init__(self, path, threads):
        self.lib = ctypes.CDLL(path)
        L, vp, i = self.lib, ctypes.c_void_p, ctypes.c_int
        L.stepq_shim_last_error.restype = ctypes.c_char_p
        L.stepq_shim_last_error.argtypes = []
        L.stepq_shim_open.argtypes = [ctypes.c_char_p, i, ctypes.POINTER(vp)]
        L.stepq_shim_open.restype = i
        L.stepq_shim_layer_index.argtypes = [vp, i]
        L.stepq_shim_layer_index.restype = i
        L.stepq_shim_shape.argtypes = [vp, ctypes.POINTER(i)]
        L.stepq_shim_shape.restype = i
        L.stepq_shim_bits_per_value.argtypes = [vp, ctypes.POINTER(ctypes.c_double)]
        L.stepq_shim_bits_per_value.restype = i
        L.stepq_shim_roundtrip.argtypes = [vp, i, vp, i]
        L.stepq_shim_roundtrip.restype = i
        L.stepq_shim_close.argtypes = [vp]
        L.stepq_shim_close.restype = None
        L.stepq_shim_cuda_open.argtypes = [vp, i]
        L.stepq_shim_cuda_open.restype = i
        L.stepq_shim_cuda_roundtrip.argtypes = [vp, i, vp, i, vp]
        L.stepq_shim_cuda_roundtrip.restype = i
        L.stepq_shim_set_row_split.argtypes = [ctypes.c_double]
        L.stepq_shim_set_row_split.restype = i
        L.stepq_shim_clear_row_split.argtypes = []
        L.stepq_shim_clear_row_split.restype = None
        L.stepq_shim_row_split.argtypes = [vp, ctypes.POINTER(ctypes.c_double)]
        L.stepq_shim_row_split.restype = i
        self.threads = threads
        self.shapes = {}  # handle value -> (HV, K, V)
        self.nlayers = {}  # handle value -> recurrent layers in the map
        self.kda = {}  # handle value -> a KDA map (key-row units)

    def err(self):
        e = self.lib.stepq_shim_last_error()
        return e.decode(errors="replace") if e else "(no detail)"

    def open(self, map_path):
        h = ctypes.c_void_p()
        if self.lib.stepq_shim_open(map_path.encode(), self.threads, ctypes.byref(h)) < 0 or not h.value:
            raise SystemExit("nll_eval: %s: %s" % (map_path, self.err()))
        out = (ctypes.c_int * 5)()
        if self.lib.stepq_shim_shape(h, out) < 0:
            raise SystemExit("nll_eval: %s: %s" % (map_path, self.err()))
        self.kda[h.value] = bool(out[4])
        self.shapes[h.value] = (out[1], out[2], out[3])
        self.nlayers[h.value] = out[0]
        return h

    def bits_per_value(self, map_path):
        """Compact bits per value of a map, from the library's accounting (config/SCHEMA.md)."""
        h = self.open(map_path)
        d = ctypes.c_double()
        rc = self.lib.stepq_shim_bits_per_value(h, ctypes.byref(d))
        self.close(h)
        if rc < 0:
            raise SystemExit("nll_eval: %s: %s" % (map_path, self.err()))
        return d.value

    def row_split(self, h):
        """The row split the host roundtrip fits the map's dual-axis heads with: the
        --row-split override when set, else the map's row_split (0.5 by default)."""
        d = ctypes.c_double()
        if self.lib.stepq_shim_row_split(h, ctypes.byref(d)) < 0:
            raise SystemExit("nll_eval: %s" % self.err())
        return d.value

    def close(self, h):
        self.lib.stepq_shim_close(h)
        self.shapes.pop(h.value, None)
        self.nlayers.pop(h.value, None)

    def shape(self, h):
        """(HV, d_k, d_v) of the map behind h."""
        return self.shapes[h.value]

    def map_layers(self, h):
        return self.nlayers[h.value]

    def layer_index(self, h, L):
        li = self.lib.stepq_shim_layer_index(h, L)
        if li < 0:
            raise SystemExit("nll_eval: layer %s is not in the map: %s" % (L, self.err()))
        return li

    def cuda_open(self, h, max_n):
        """0 when the CUDA pack/unpack path is usable for this map, else the error text."""
        if self.lib.stepq_shim_cuda_open(h, max_n) < 0:
            return self.err()
        return 0

    def cuda_roundtrip(self, h, li, dev_states, stream):
        _check_states(dev_states, self.shape(h), "CUDA roundtrip")
        n = dev_states.shape[0]
        if self.lib.stepq_shim_cuda_roundtrip(h, li, ctypes.c_void_p(_ptr(dev_states)), n,
                                              ctypes.c_void_p(stream)) < 0:
            raise SystemExit("nll_eval: CUDA roundtrip: %s" % self.err())

    def roundtrip(self, h, li, cpu_states):
        _check_states(cpu_states, self.shape(h), "roundtrip")
        if hasattr(cpu_states, "is_cuda") and cpu_states.is_cuda:
            raise SystemExit("nll_eval: roundtrip: the CPU path got device memory")
        n = cpu_states.shape[0]
        if self.lib.stepq_shim_roundtrip(h, li, ctypes.c_void_p(_ptr(cpu_states)), n) < 0:
            raise SystemExit("nll_eval: roundtrip: %s" % self.err())


def row_split_check(shim, maps, rng):
    """A map's row_split is the host roundtrip's fit: the stepq@6 map rewritten with
    "row_split": 0.75 stores what the original stores under the override 0.75, and not
    what it stores without; the CUDA path refuses the 0.75 map (or is absent)."""
    import tempfile
    import numpy as np
    path = maps.get("stepq@6")
    if path is None:
        return
    with open(path) as f:
        text = f.read()
    assert '"row_split"' not in text
    text = text.replace('"budget_bits": 6,', '"budget_bits": 6,\n  "row_split": 0.75,', 1)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(text)
    try:
        h50, h75 = shim.open(path), shim.open(f.name)
        assert shim.row_split(h50) == 0.5 and shim.row_split(h75) == 0.75
        shape = shim.shape(h50)
        x = (rng.standard_normal((2,) + shape) * np.exp(rng.standard_normal((2, shape[0], shape[1], 1)))
             * 0.1).astype(np.float32)
        y50, y75, yo = (np.ascontiguousarray(x.copy()) for _ in range(3))
        shim.roundtrip(h50, 0, y50)
        shim.roundtrip(h75, 0, y75)
        assert not np.array_equal(y50, y75)
        if shim.lib.stepq_shim_set_row_split(0.75) != 0:
            raise SystemExit("nll_eval: self-test: stepq_shim_set_row_split: %s" % shim.err())
        try:
            assert shim.row_split(h50) == 0.75
            shim.roundtrip(h50, 0, yo)
        finally:
            shim.lib.stepq_shim_clear_row_split()
        assert np.array_equal(yo, y75)
        assert shim.row_split(h50) == 0.5
        rc = shim.lib.stepq_shim_cuda_open(h75, 2)
        e = shim.err() if rc < 0 else "opened"  # the kernels fit with the map's split
        assert rc == 0 or "no CUDA device" in e or "without CUDA" in e, e
        print("self-test: row_split 0.75 map = its map under the override; CUDA path: %s" % e)
        shim.close(h50)
        shim.close(h75)
    finally:
        os.unlink(f.name)


def check_decode_fit(path, who="nll_eval"):
    """Refuses a map whose decode_fit is not the exact fit, or whose arith is not fp32
    (config/SCHEMA.md).

    This harness stores every state through the library's prefill pack and unpack
    (the shim's roundtrip), and a prefill pack always takes the exact dual-axis fit in
    fp32 arithmetic: decode_fit norefit or rows and arith fp16 only change the decode
    step. Measuring such a map here would silently measure the exact fp32 fit under its
    name, so it is refused; the served path's drift probe
    (tools/scripts/served_path.py --check drift) runs real decode steps and measures them."""
    with open(path) as f:
        m = json.load(f)
    fit, arith = m.get("decode_fit", "exact"), m.get("arith", "fp32")
    if fit != "exact":
        raise SystemExit("%s: %s: decode_fit \"%s\": this harness stores states through the prefill "
                         "pack, which always fits exactly, so the map's decode fit would not be measured; "
                         "use tools/scripts/served_path.py --check drift for it" % (who, path, fit))
    if arith != "fp32":
        raise SystemExit("%s: %s: arith \"%s\": this harness stores states through the prefill "
                         "pack, which always computes in fp32, so the map's decode arithmetic would not be "
                         "measured; use tools/scripts/served_path.py --check drift for it"
                         % (who, path, arith))


def self_test(a):
    """The parts that need no torch: the shim's entry points and checks, the maps, the accounting."""
    import glob
    import numpy as np
    here = os.path.dirname(os.path.abspath(__file__))
    specs = [sp.partition("=")[::2] for sp in a.map] or [
        (os.path.basename(p)[:-5], p)
        for p in sorted(glob.glob(os.path.join(here, "..", "..", "config", "calibrated", "tiny-gdn", "*.json")))]
    if not specs:
        raise SystemExit("nll_eval: self-test: no maps")
    assert ms([1.0, 2.0, 3.0]) == (2.0, math.sqrt(1.0 / 3.0)), ms([1.0, 2.0, 3.0])
    assert ms([5.0]) == (5.0, 0.0)
    shim = Shim(a.shim, a.threads)
    rng = np.random.default_rng(1)
    errs = {}
    for name, path in specs:
        check_decode_fit(path)
        with open(path) as f:
            m = json.load(f)
        bpv = shim.bits_per_value(path)
        if m["method"] in ("fp32", "bf16", "fp16"):
            print("self-test: %-16s dense %s, %.3f bits/value" % (name, m["method"], bpv))
            continue
        md = m["model"]
        shape = (md["num_v_heads"], md["head_k_dim"], md["head_v_dim"])
        ids = md["recurrent_layers"]
        h = shim.open(path)
        assert shim.shape(h) == shape, (shim.shape(h), shape)
        assert shim.row_split(h) == m.get("row_split", 0.5), (name, shim.row_split(h))
        assert shim.map_layers(h) == len(ids)
        assert [shim.layer_index(h, L) for L in ids] == list(range(len(ids)))
        non = [L for L in range(max(ids) + 2) if L not in ids]
        if non:
            assert shim.lib.stepq_shim_layer_index(h, non[0]) < 0
        # Uniform widths: compact bits = b + row scales (+ column scales).
        col = m["method"] in ("dsq", "spatial", "stepq")
        widths = {hd["bits"] for ly in m.get("layers", []) for hd in ly["heads"]}
        if m["method"] == "fp8":
            # e4m3 bytes + one fp32 scale per (head, 32 value columns).
            want = 8 + 32.0 * -(-shape[2] // 32) / (shape[1] * shape[2])
            assert abs(bpv - want) < 1e-9, (name, bpv, want)
        elif len(widths) == 1 and 16 not in widths:
            b = widths.pop()
            want = b + 16.0 / shape[2] + (16.0 / shape[1] if col else 0.0)
            assert abs(bpv - want) < 1e-9, (name, bpv, want)
        n = 3
        x = (rng.standard_normal((n,) + shape) * np.exp(rng.standard_normal((n, shape[0], shape[1], 1)))
             * np.exp(rng.standard_normal((n, shape[0], 1, shape[2]))) * 0.1).astype(np.float32)
        tot = 0.0
        for li in range(len(ids)):
            y = np.ascontiguousarray(x.copy())
            shim.roundtrip(h, li, y)
            assert np.isfinite(y).all()
            rel = float(((y - x) ** 2).sum() / (x ** 2).sum())
            assert 0.0 < rel < 0.5, (name, li, rel)
            # The same input gives the same output (deterministic, thread-count independent).
            z = np.ascontiguousarray(x.copy())
            shim.roundtrip(h, li, z)
            assert np.array_equal(y, z), (name, li)
            tot += rel
        errs[name] = tot / len(ids)
        for bad, why in ((x[:, :, :, :64].copy(), "shape"), (x.astype(np.float64), "dtype"),
                         (np.asfortranarray(x), "layout")):
            try:
                shim.roundtrip(h, 0, bad)
            except SystemExit:
                pass
            else:
                raise AssertionError("roundtrip accepted a bad %s" % why)
        assert shim.lib.stepq_shim_roundtrip(h, len(ids), ctypes.c_void_p(x.ctypes.data), 1) < 0
        print("self-test: %-16s %-8s %.3f bits/value, relative squared error %.3e"
              % (name, m["method"], bpv, errs[name]))
        shim.close(h)
    u = [errs.get("uniform@%d" % b) for b in (4, 6, 8)]
    if None not in u:
        assert u[0] > u[1] > u[2], u
    row_split_check(shim, dict(specs), rng)
    print("self-test: OK")
    return 0


def main(argv=None):
    a = parse_args(argv)
    if a.self_test:
        return self_test(a)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(text_streams(a.text, a.streams, a.prefill, a.decode, a.offset, "nll_eval"),
                       dtype=torch.long, device=a.device)

    mdt = torch.bfloat16 if a.model_dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=mdt).to(a.device).eval()

    # Route the recurrent kernels through a wrapper that stores the returned state. The
    # recurrent layers (GDN: transformers' Qwen3_5GatedDeltaNet and kin; KDA:
    # KimiLinearDeltaAttention) call module-level kernel functions by name (prefill and
    # one-token decode; the names per release are in hf_names.py), with initial_state = the
    # cache's state and output_final_state = True, and store the returned state
    # [B, HV, d_k, d_v] (fp32) with cache_params.update_recurrent_state(); older versions call
    # instance attributes instead. All are wrapped; a depth counter makes sure a state is
    # stored through the method once even if one wrapped function calls another.
    state = {"layer": None, "fn": None, "depth": 0}
    try:
        found, mods = hf_names.recurrent_layers(model)
    except hf_names.HFNamesError as e:
        raise SystemExit("nll_eval: %s" % e)
    layers = [m for _, m in found]
    for m in layers:
        def pre(module, args, L=m.layer_idx):
            state["layer"] = L
        m.register_forward_pre_hook(pre)
    # Per layer: stores through the method, of them with no initial state (must be the
    # prefill only), and the last state handed back to the layer (checked against the cache).
    calls = {"per_layer": {}, "fresh": {}, "names": {}, "last": {}}

    def wrap(fn, name):
        def wrapped(*args, **kwargs):
            state["depth"] += 1
            try:
                out, st = fn(*args, **kwargs)
            finally:
                state["depth"] -= 1
            if st is not None and state["fn"] is not None and state["depth"] == 0:
                L = state["layer"]
                if L is None:
                    raise SystemExit("nll_eval: a recurrent kernel ran outside a recurrent layer")
                st = state["fn"](st, L)
                calls["per_layer"][L] = calls["per_layer"].get(L, 0) + 1
                if kwargs.get("initial_state", 0) is None:
                    calls["fresh"][L] = calls["fresh"].get(L, 0) + 1
                calls["names"][name] = calls["names"].get(name, 0) + 1
                calls["last"][L] = st
            return out, st
        wrapped.__wrapped_by_nll_eval__ = True
        return wrapped
    try:
        hf_names.wrap_kernels(found, mods, wrap, "__wrapped_by_nll_eval__")
    except hf_names.HFNamesError as e:
        raise SystemExit("nll_eval: %s" % e)

    shim = Shim(a.shim, a.threads)
    if a.row_split is not None:
        if shim.lib.stepq_shim_set_row_split(a.row_split) != 0:
            raise SystemExit("nll_eval: --row-split: " + shim.err())
    try:
        arch, _, HV, K, V = hf_names.model_shape(model.config)
    except hf_names.HFNamesError as e:
        raise SystemExit("nll_eval: %s" % e)
    model_state_shape = (HV, K, V)
    lin_layers = sorted(m.layer_idx for m in layers)
    backend_used = {}
    row_splits = {}  # map methods -> the row split of their host fit (0.5 without a dual-axis fit)
    methods = [("fp32", None)] + ([] if a.no_bf16 else [("bf16", None)])
    shrinks = {shrink_name(g): g for g in a.shrink}
    methods += [(n, None) for n in shrinks]
    jitters = {jitter_name(k): k for k in range(1, a.jitter + 1)}
    methods += [(n, None) for n in jitters]
    for spec in a.map:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise SystemExit("nll_eval: --map %s: expected NAME=PATH" % spec)
        if any(name == n for n, _ in methods):
            raise SystemExit("nll_eval: --map %s: method name %s is taken" % (spec, name))
        if not os.path.isfile(path):
            raise SystemExit("nll_eval: --map %s: no such file" % spec)
        check_decode_fit(path)
        methods.append((name, path))

    def make_fn(name, path):
        if name == "fp32" and path is None:
            return lambda st, L: st
        if name == "bf16" and path is None:
            return lambda st, L: st.to(torch.bfloat16).to(st.dtype)
        if name in shrinks and path is None:
            return lambda st, L, g=shrinks[name]: st * g
        if name in jitters and path is None:
            gens = {}

            def fn_jitter(st, L, k=jitters[name]):
                if st.device not in gens:  # one stream of draws per method, fresh every step
                    gens[st.device] = torch.Generator(device=st.device).manual_seed(k)
                e = torch.rand(st.shape, generator=gens[st.device], device=st.device, dtype=torch.float32)
                x = st.to(torch.float32) * (1.0 + (2.0 * e - 1.0) * JITTER)
                return x.to(torch.bfloat16).to(st.dtype)
            return fn_jitter
        h = shim.open(path)
        # The map must be for this model's state: arch, shape, and every recurrent layer (by model layer id).
        if shim.kda[h.value] != (arch == "kda"):
            raise SystemExit("nll_eval: %s: a %s map for a %s model" % (path, "KDA" if shim.kda[h.value] else "GDN",
                                                                       arch.upper()))
        if shim.shape(h) != model_state_shape:
            raise SystemExit("nll_eval: %s: map state shape %s, model %s" % (path, shim.shape(h), model_state_shape))
        if shim.map_layers(h) != len(lin_layers):
            raise SystemExit("nll_eval: %s: map has %d recurrent layers, model %d"
                             % (path, shim.map_layers(h), len(lin_layers)))
        lidx = {L: shim.layer_index(h, L) for L in lin_layers}
        row_splits[name] = shim.row_split(h)
        bufs = {}
        use_cuda = False
        if a.backend != "cpu" and a.device.startswith("cuda"):
            err = shim.cuda_open(h, a.streams)
            if err == 0:
                # Check the CUDA path against the C reference on state-like data, every layer
                # (their bit widths differ): the two must agree to within 1% of the
                # quantization error (codes may differ by a tie).
                g = torch.Generator(device="cpu").manual_seed(1)
                HVKV = model_state_shape
                ratios = []
                for L in lin_layers:
                    x = (torch.randn((a.streams,) + HVKV, generator=g) *
                         torch.exp(torch.randn((a.streams, HVKV[0], HVKV[1], 1), generator=g)) *
                         torch.exp(torch.randn((a.streams, HVKV[0], 1, HVKV[2]), generator=g)) * 0.1)
                    ref = x.clone().contiguous()
                    shim.roundtrip(h, lidx[L], ref)
                    dev = x.to(a.device).contiguous()
                    shim.cuda_roundtrip(h, lidx[L], dev, torch.cuda.current_stream().cuda_stream)
                    torch.cuda.synchronize()
                    got = dev.cpu()
                    qerr = ((ref - x) ** 2).sum().item()
                    diff = ((got - ref) ** 2).sum().item()
                    ratio = diff / qerr if qerr > 0 else (0.0 if diff == 0 else float("inf"))
                    ratios.append(ratio)
                worst = float("nan") if any(math.isnan(r) for r in ratios) else max(ratios)
                use_cuda = worst <= 1e-2
                print("nll_eval: %s: CUDA vs C reference, squared difference / quantization error = %.2e "
                      "(worst layer): %s" % (name, worst, "using CUDA" if use_cuda else "using the CPU reference"),
                      file=sys.stderr)
            else:
                print("nll_eval: %s: CUDA path unavailable (%s); using the CPU reference" % (name, err),
                      file=sys.stderr)
            if a.backend == "cuda" and not use_cuda:
                raise SystemExit("nll_eval: --backend cuda: not usable for %s" % name)
        backend_used[name] = "cuda" if use_cuda else "cpu"
        if use_cuda:
            def fn_cuda(st, L):
                x = st.detach().to(torch.float32).contiguous().clone()
                shim.cuda_roundtrip(h, lidx[L], x, torch.cuda.current_stream().cuda_stream)
                return x.to(st.dtype)
            return fn_cuda

        def fn(st, L):
            key = tuple(st.shape)
            if key not in bufs:  # one pinned host buffer per shape, reused every step
                bufs[key] = torch.empty(key, dtype=torch.float32, pin_memory=st.is_cuda)
            cpu = bufs[key]
            cpu.copy_(st.detach())
            shim.roundtrip(h, lidx[L], cpu)
            out = torch.empty_like(st)
            out.copy_(cpu)
            return out
        return fn

    cache_state = hf_names.cache_state

    notes = []

    def check_calls(cache, steps, when):
        """Every recurrent layer stored its state through the method once per forward (the first
        with no initial state: the prefill), and the cache holds exactly what was handed back."""
        for L in lin_layers:
            n, fresh = calls["per_layer"].get(L, 0), calls["fresh"].get(L, 0)
            if n != steps or fresh > 1:
                raise SystemExit("nll_eval: %s: layer %d stored %d states (%d without an initial state), "
                                 "expected %d (1): the kernel wrapper does not see every step (%s)"
                                 % (when, L, n, fresh, steps, calls["names"]))
            if cache is None:
                continue
            t = cache_state(cache, L)
            if t is None:
                if "no-cache-check" not in notes:
                    notes.append("no-cache-check")
                    print("nll_eval: WARNING: cannot read the cache's recurrent state; "
                          "not checking that it holds the stored state", file=sys.stderr)
                continue
            last = calls["last"][L]
            if t.dtype != last.dtype:
                msg = "cache keeps the state in %s, the kernel returns %s" % (t.dtype, last.dtype)
                if msg not in notes:
                    notes.append(msg)
                    print("nll_eval: WARNING: %s" % msg, file=sys.stderr)
            if tuple(t.shape) != tuple(last.shape) or not torch.equal(t, last.to(t.dtype)):
                raise SystemExit("nll_eval: %s: layer %d: the cache's recurrent state is not the stored one"
                                 % (when, L))

    # Teacher forcing check: with the fp32 state, prefill + one-token decode steps must give
    # the predictions of one full forward over the same bytes (up to bf16 noise). Logits at
    # position t predict byte t+1: positions P..P+D-1 predict bytes P+1..P+D.
    S = a.streams
    state["fn"] = None
    with torch.no_grad():
        lg = model(input_ids=ids[:, :a.prefill + a.decode], use_cache=False).logits[:, a.prefill:]
        full_nll = -torch.log_softmax(lg.float(), dim=-1).gather(
            2, ids[:, a.prefill + 1:a.prefill + a.decode + 1].unsqueeze(2)).squeeze(2).double().cpu()
        del lg
    if tuple(full_nll.shape) != (S, a.decode):
        raise SystemExit("nll_eval: full forward gave NLL of shape %s" % (tuple(full_nll.shape),))

    # Methods run side by side in one batch (streams x methods): the tiny model's forward is
    # cheap and mostly launch overhead, so this is several times faster than one run per
    # method, and every method sees the same kernels (same batch size) as its fp32 reference.
    # fp32 is in every group; excess NLL is taken within the group.
    others = [m for m in methods if m[0] != "fp32"]
    G = a.group if a.group > 0 else max(1, len(others))
    groups = [[("fp32", None)] + others[i:i + G] for i in range(0, len(others), G)] or [[("fp32", None)]]
    results = {}
    decode_vs_full = None
    for grp in groups:
        fns = [make_fn(name, path) for name, path in grp]
        Mg = len(grp)
        B = Mg * S
        full_shape = (B,) + model_state_shape

        def group_fn(st, L, fns=fns, full_shape=full_shape):
            if tuple(st.shape) != full_shape:
                raise SystemExit("nll_eval: layer %d returned a state of shape %s, expected %s [B, HV, d_k, d_v]"
                                 % (L, tuple(st.shape), full_shape))
            out = torch.empty_like(st)
            for m, fn in enumerate(fns):
                out[m * S:(m + 1) * S] = fn(st[m * S:(m + 1) * S], L)
            return out
        state["fn"] = group_fn
        calls.update(per_layer={}, fresh={}, names={}, last={})
        t0 = time.time()
        idg = ids.repeat(Mg, 1)  # row m*S + s: method m, stream s
        nll = torch.zeros(B, a.decode, dtype=torch.float64)
        with torch.no_grad():
            out = model(input_ids=idg[:, :a.prefill], use_cache=True)
            cache = out.past_key_values
            check_calls(cache, 1, "prefill")
            for i in range(a.decode):
                p = a.prefill + i
                out = model(input_ids=idg[:, p:p + 1], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                if i == 0:
                    check_calls(cache, 2, "first decode step")
                lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
                nll[:, i] = -lp.gather(1, idg[:, p + 1:p + 2]).squeeze(1).double().cpu()
        state["fn"] = None
        check_calls(cache, 1 + a.decode, "decode")
        del cache, out
        dt = time.time() - t0
        ref = nll[0:S]
        dvf = (ref - full_nll).mean(dim=1).abs().max().item()
        decode_vs_full = dvf if decode_vs_full is None else max(decode_vs_full, dvf)
        print("nll_eval: fp32 state, decode vs full forward: max over streams of |mean NLL difference| = %.2e"
              % dvf, file=sys.stderr)
        if not dvf < 0.1:
            raise SystemExit("nll_eval: the cached decode (fp32 state) does not reproduce the full forward "
                             "(%.3g nats/byte apart): the teacher forcing is broken" % dvf)
        for m, (name, path) in enumerate(grp):
            r = nll[m * S:(m + 1) * S]
            if name == "fp32" and name in results:
                continue
            results[name] = {"nll": r, "ref": ref, "path": path, "seconds": dt}
            print("nll_eval: %-16s mean NLL %.4f nats/byte, excess %+.5f" % (
                name, r.mean().item(), (r - ref).mean().item()), file=sys.stderr)
        print("nll_eval: group of %d methods x %d streams: %.0f s (%s)" % (Mg, S, dt, calls["names"]),
              file=sys.stderr)

    table = excess_table(results, lambda name, path: 32.0 if (name == "fp32" or name in shrinks) and path is None
                         else 16.0 if (name == "bf16" or name in jitters) and path is None
                         else shim.bits_per_value(path))
    meta = {"model": a.model, "arch": arch, "text": os.path.basename(a.text), "streams": S, "prefill": a.prefill,
            "decode": a.decode, "offset": a.offset, "model_dtype": a.model_dtype,
            "torch": torch.__version__, "transformers": transformers.__version__, "backend": backend_used,
            "decode_vs_full_fp32": decode_vs_full, "notes": notes,
            "row_split_override": a.row_split, "row_splits": row_splits}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": table}, f, indent=1)
    md = excess_markdown(table, S, meta["text"], a.prefill, a.decode)
    print(md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
