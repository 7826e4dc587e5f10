#!/usr/bin/env python3
"""Would fp16 arithmetic inside the packed decode step cost accuracy? A design check for issue #15.

The fused step spends most of its instructions on per-element fp32 arithmetic: reconstruct
x = z a_i c_j, the rank-1 update x += k u^T, the row and column maxima, y = x / r_i. Packed
half2 instructions would do two elements each, but the state would then pass through fp16
three times per token (after the reconstruction, after the update, and as y). This simulates
one GDN-like head (d = 128, scalar gate, unit-norm k and q, the dual-axis fit with its
least-squares column refit, one width, no pivots) twice over T tokens against an fp32 state:

  fp32  every operation in fp32, as the shipped kernel and kernels/quant.c;
  fp16  x after the reconstruction, x after the update and y = x / r_i rounded to fp16, each
        after an exact power-of-two normalisation of the block (2^e >= its largest magnitude, so
        fp16's range never binds: the scale a kernel would take from the maxima it computes anyway);
        u likewise; the dot products S^T k and S^T q accumulate fp16 products in fp32 (tensor-core mma
        semantics); scales, the quantize and the refit sums stay fp32.

It prints the readout error sum |o^ - o|^2 / sum |o|^2 of both, mean +- s.e. over --seeds
streams, and their ratio. Synthetic states only: what the model sees is the drift probe's
business (served_path.py --check drift), once a kernel and a C reference of the fp16 path exist.

  python3 tools/scripts/fp16_step_sim.py [--tokens 1024] [--seeds 4] [--bits 6,4] [--gates 0.99,0.999] [--scale 1]

needs numpy only (about two minutes on two cores with the defaults).
"""
import argparse
import math
import sys

try:
    import numpy as np
except ImportError:
    sys.exit("fp16_step_sim.py: needs numpy")

F32, F16 = np.float32, np.float16
D = 128


def pow2_above(m):
    """The smallest power of two >= m (> 0): dividing by it is exact and bounds |x| by 1."""
    return F32(2.0 ** math.ceil(math.log2(max(float(m), 1e-30))))


def to_f16(x, bound):
    """x rounded to fp16 in the block's normalised domain (x / 2^e), returned unnormalised."""
    e = pow2_above(bound)
    return (x / e).astype(F16).astype(F32) * e


def fit(x, qmax, half):
    """The dual-axis fit at row split 0.5, row impact 1: r_i = fp16(sqrt(max_j |x_ij|)),
    y = x / r_i, c_j = fp16(max_i |y_ij|), z = rint(y qmax / c_j), then c_j refit by least
    squares with the codes fixed. Returns z, r, c (scales as fp16 values in fp32)."""
    m = np.abs(x).max(axis=1)
    r = np.sqrt(np.maximum(m, 1e-30)).astype(F16).astype(F32)
    r[m == 0] = 1.0
    y = x * (F32(1.0) / r)[:, None]
    if half:
        y = to_f16(y, np.abs(y).max())
    c = np.abs(y).max(axis=0).astype(F16).astype(F32)
    c[c == 0] = 1.0
    z = np.clip(np.rint(y * (F32(qmax) / c)[None, :]), -qmax, qmax)
    w = r * r
    num, den = (w[:, None] * z * y).sum(axis=0), (w[:, None] * z * z).sum(axis=0)
    ok = den > 0
    c = np.where(ok, F32(qmax) * num / np.where(ok, den, 1), c)
    c = np.abs(c).astype(F16).astype(F32)
    c[c == 0] = 1.0
    return z.astype(F32), r, c


def stream(bits, gate, tokens, seed, half, scale=1.0):
    rng = np.random.default_rng(seed)
    qmax = 2 ** (bits - 1) - 1
    S = np.zeros((D, D), F32)
    z, r, c = np.zeros((D, D), F32), np.ones(D, F32), np.ones(D, F32)
    err = ref = 0.0
    for _ in range(tokens):
        k = rng.standard_normal(D).astype(F32)
        k /= np.linalg.norm(k)
        q = rng.standard_normal(D).astype(F32)
        q /= np.linalg.norm(q)
        v = (rng.standard_normal(D) * scale).astype(F32)
        g = F32(gate * (0.98 + 0.02 * rng.random()))
        beta = F32(0.2 + 0.6 * rng.random())
        # the fp32 state
        S *= g
        u = beta * (v - S.T @ k)
        S += np.outer(k, u)
        o = S.T @ q
        # the packed step
        x = (z * (r * g / F32(qmax))[:, None]) * c[None, :]
        if half:
            x = to_f16(x, np.abs(r).max() * g * np.abs(c).max())
            kh, qh = k.astype(F16).astype(F32), q.astype(F16).astype(F32)
        else:
            kh, qh = k, q
        uq = beta * (v - x.T @ kh)
        oq = x.T @ qh
        if half:
            uh = to_f16(uq, np.abs(uq).max())
            x = to_f16(np.outer(kh, uh) + x, np.abs(x).max() + np.abs(kh).max() * np.abs(uh).max())
        else:
            x = np.outer(k, uq) + x
        oq = oq + uq * F32(k @ q)
        z, r, c = fit(x, qmax, half)
        err += float(((oq - o) ** 2).sum())
        ref += float((o ** 2).sum())
    return err / ref


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--bits", default="6,4")
    p.add_argument("--gates", default="0.99,0.999", help="mean gate per token (half-life ln 2 / (1 - g))")
    p.add_argument("--scale", type=float, default=1.0, help="v's scale, so the state's (1e-6: below fp16's normal range)")
    a = p.parse_args()
    if a.tokens < 1 or a.seeds < 2:
        p.error("--tokens >= 1 and --seeds >= 2")
    print("| bits | gate | readout error, fp32 step | fp16 step | fp16 / fp32 |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for b in (int(x) for x in a.bits.split(",")):
        for g in (float(x) for x in a.gates.split(",")):
            row = []
            for half in (False, True):
                e = [stream(b, g, a.tokens, s, half, a.scale) for s in range(a.seeds)]
                row.append((float(np.mean(e)), float(np.std(e, ddof=1) / math.sqrt(len(e)))))
                print("  bits %d gate %g %s done" % (b, g, "fp16" if half else "fp32"), file=sys.stderr, flush=True)
            print("| %d | %g | %.4e +- %.1e | %.4e +- %.1e | %.3f |"
                  % (b, g, row[0][0], row[0][1], row[1][0], row[1][1], row[1][0] / row[0][0]), flush=True)
    print("\n%d streams of %d tokens per row (seeds 0..%d), d = %d, v scaled by %g; the same streams in both columns."
          % (a.seeds, a.tokens, a.seeds - 1, D, a.scale))


if __name__ == "__main__":
    main()
