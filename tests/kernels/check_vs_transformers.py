#!/usr/bin/env python3
"""External check of the fp32 reference recurrence against transformers.

Runs the C reference (tests/kernels/ref_shim.c, loaded with ctypes) and
transformers' pure-torch recurrences on the same random inputs and compares
outputs and final states:

  GDN: transformers.models.qwen3_next.modeling_qwen3_next.torch_recurrent_gated_delta_rule
  KDA: transformers.models.kimi_linear.modeling_kimi_linear.torch_recurrent_kda

Both take q, k, v as [B, T, H, D] with as many q/k heads as value heads, so
grouped value heads (GVA) are expanded here with repeat_interleave, as the
models do before calling them, while the C reference gets the unexpanded q/k.
They l2-normalise q and k (use_qk_l2norm_in_kernel=True), scale q by
d_k^-1/2 and return the state as [B, H, K, V].

With a CUDA device (stepq_ref_shim_has_cuda()), the CUDA dense fp32 decode
step (stepq__cuda_step_dense, state on the device for all steps) is checked
the same way at the shape it supports, d_k = d_v = 128, over 1024 steps with
grouped value heads (target: <= 1e-5 relative to transformers); its distance
to the C reference is printed as information. Without a device that part
prints "skipped: no CUDA device" and the CPU checks still decide the result.

Usage: check_vs_transformers.py [path/to/libstepq_ref_shim.so]
       (default: build-gpu/tests/kernels/libstepq_ref_shim.so, then build/...)
Exit status: 0 all within tolerance, 1 a mismatch, 77 torch/transformers or
the shim missing (meson's "skipped").
"""
import ctypes
import inspect
import os
import sys

TOL = 1e-5
GDN, KDA = 0, 1
ENODEV = -19  # STEPQ_ENODEV: the CUDA part is skipped, not failed


def find_shim(argv):
    if len(argv) > 1:
        return argv[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for build in ("build-gpu", "build"):
        path = os.path.join(root, build, "tests", "kernels", "libstepq_ref_shim.so")
        if os.path.exists(path):
            return path
    return None


def main(argv):
    try:
        import torch
        import torch.nn.functional as F
        from transformers.models.kimi_linear import modeling_kimi_linear as kimi
        from transformers.models.qwen3_next import modeling_qwen3_next as qwen
    except ImportError as e:
        print(f"skipped: {e}")
        return 77
    shim_path = find_shim(argv)
    if not shim_path or not os.path.exists(shim_path):
        print(f"skipped: reference shim library not found ({shim_path})")
        return 77

    lib = ctypes.CDLL(shim_path)
    fp = ctypes.c_void_p
    lib.stepq_ref_shim_run.argtypes = [ctypes.c_int] * 7 + [fp] * 7 + [
        ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, fp, fp]
    lib.stepq_ref_shim_run.restype = ctypes.c_int
    lib.stepq_ref_shim_run_cuda.argtypes = lib.stepq_ref_shim_run.argtypes
    lib.stepq_ref_shim_run_cuda.restype = ctypes.c_int
    lib.stepq_ref_shim_has_cuda.argtypes = []
    lib.stepq_ref_shim_has_cuda.restype = ctypes.c_int
    lib.stepq_ref_shim_last_error.restype = ctypes.c_char_p

    # The hub decorator may route to a Triton kernel on CUDA tensors; the
    # check wants the pure-torch reference, on CPU.
    gdn_ref = inspect.unwrap(qwen.torch_recurrent_gated_delta_rule)
    # transformers 5.17 names the pure-torch KDA recurrence recurrent_kimi_delta_attention
    # (same arguments and [B, T, HV, D] layout); other releases call it torch_recurrent_kda.
    kda_fn = getattr(kimi, "torch_recurrent_kda", None) or getattr(kimi, "recurrent_kimi_delta_attention")
    kda_ref = inspect.unwrap(kda_fn)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")

    def ptr(t):
        return ctypes.c_void_p(t.data_ptr()) if t is not None else None

    def call(fn, arch, q, k, v, g, beta, state0, chunk, A_log, dt_bias, raw):
        B, T, H, dk = q.shape
        HV, dv = v.shape[2], v.shape[3]
        state = state0.clone().contiguous()
        o = torch.zeros(B, T, HV, dv, dtype=torch.float32)
        args = [q, k, v, g, beta, A_log, dt_bias]
        args = [a.contiguous() if a is not None else None for a in args]
        rc = fn(arch, B, T, H, HV, dk, dv, *[ptr(a) for a in args],
                1, 0.0, int(raw), int(raw), chunk, ptr(state), ptr(o))
        return rc, o, state

    def run_c(arch, q, k, v, g, beta, state0, chunk, A_log=None, dt_bias=None, raw=False):
        rc, o, state = call(lib.stepq_ref_shim_run, arch, q, k, v, g, beta, state0, chunk,
                            A_log, dt_bias, raw)
        if rc != 0:
            raise RuntimeError(f"reference returned {rc}: {lib.stepq_ref_shim_last_error().decode()}")
        return o, state

    def run_cuda(arch, q, k, v, g, beta, state0, A_log=None, dt_bias=None, raw=False):
        """The CUDA decode step, token by token; (rc, o, state), rc < 0 on an error."""
        return call(lib.stepq_ref_shim_run_cuda, arch, q, k, v, g, beta, state0, 0,
                    A_log, dt_bias, raw)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    failures = 0

    def report(name, o, s, o_ref, s_ref, checked=True):
        nonlocal failures
        eo, es = rel(o, o_ref), rel(s, s_ref)
        if not checked:
            print(f"info {name}: output rel err {eo:.3e}, state rel err {es:.3e}")
            return
        ok = eo <= TOL and es <= TOL
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: output rel err {eo:.3e}, state rel err {es:.3e}"
              f" (tolerance {TOL:g})")

    def make_inputs(arch, B, T, H, HV, DK, DV):
        q = torch.randn(B, T, H, DK)
        k = torch.randn(B, T, H, DK)
        v = torch.randn(B, T, HV, DV)
        n_g = DK if arch == KDA else 1
        # Raw gate inputs; long-lived gates (retention near 1) with some fast heads.
        a = torch.randn(B, T, HV, n_g) * 2.0 - 2.0
        A_log = torch.rand(HV) * 2.0 - 4.0
        dt_bias = torch.randn(HV, n_g) * 0.5
        g = -A_log.exp()[:, None] * F.softplus(a + dt_bias)
        b_raw = torch.randn(B, T, HV)
        beta = torch.sigmoid(b_raw)
        state0 = torch.randn(B, HV, DK, DV) * 0.1
        if arch == GDN:
            g, a, dt_bias = g[..., 0], a[..., 0], dt_bias[:, 0]
        return q, k, v, g, beta, a, b_raw, A_log, dt_bias, state0

    def run_transformers(arch, q, k, v, g, beta, state0):
        G = v.shape[2] // q.shape[2]
        qx, kx = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
        fn = gdn_ref if arch == GDN else kda_ref
        out = fn(qx, kx, v, g, beta, initial_state=state0.clone(), output_final_state=True,
                 use_qk_l2norm_in_kernel=True)
        return fn.__name__, out[0].float(), out[1].float()

    torch.manual_seed(1234)
    B, T, H, HV, DK, DV = 2, 320, 2, 6, 64, 48
    for arch, name in ((GDN, "gdn"), (KDA, "kda")):
        q, k, v, g, beta, a, b_raw, A_log, dt_bias, state0 = make_inputs(arch, B, T, H, HV, DK, DV)
        fname, o_ref, s_ref = run_transformers(arch, q, k, v, g, beta, state0)

        shape = f"B={B} T={T} H={H} HV={HV} d_k={DK} d_v={DV}"
        o, s = run_c(arch, q, k, v, g, beta, state0, 0)
        report(f"{name} decode step x{T} vs {fname} [{shape}]", o, s, o_ref, s_ref)
        o, s = run_c(arch, q, k, v, a, b_raw, state0, 0, A_log, dt_bias, raw=True)
        report(f"{name} decode, gate and beta in kernel", o, s, o_ref, s_ref)
        for chunk in (64, 100):
            o, s = run_c(arch, q, k, v, g, beta, state0, chunk)
            report(f"{name} chunked prefill (chunk {chunk})", o, s, o_ref, s_ref)

    # The CUDA fp32 decode step: d_k = d_v = 128, the only shape it
    # implements, 1024 steps, 2 value heads per q/k head.
    def check_cuda():
        nonlocal failures
        if not lib.stepq_ref_shim_has_cuda():
            print("skipped: no CUDA device (CUDA fp32 decode step vs transformers)")
            return
        torch.manual_seed(5)
        B, T, H, HV, DK, DV = 2, 1024, 2, 4, 128, 128
        shape = f"B={B} T={T} H={H} HV={HV} d_k={DK} d_v={DV}"
        for arch, name in ((GDN, "gdn"), (KDA, "kda")):
            q, k, v, g, beta, a, b_raw, A_log, dt_bias, state0 = make_inputs(
                arch, B, T, H, HV, DK, DV)
            fname, o_ref, s_ref = run_transformers(arch, q, k, v, g, beta, state0)
            for raw in (False, True):
                gates = (a, b_raw, A_log, dt_bias) if raw else (g, beta, None, None)
                what = f"{name} cuda fp32 decode x{T}"
                what += ", gate and beta in kernel" if raw else f" vs {fname} [{shape}]"
                rc, o, s = run_cuda(arch, q, k, v, *gates[:2], state0, *gates[2:], raw=raw)
                err = lib.stepq_ref_shim_last_error().decode() if rc else ""
                if rc == ENODEV:
                    print(f"skipped: no CUDA device ({err})")
                    return
                if rc != 0:
                    failures += 1
                    print(f"FAIL {what}: returned {rc}: {err}")
                    continue
                report(what, o, s, o_ref, s_ref)
                o_c, s_c = run_c(arch, q, k, v, *gates[:2], state0, 0, *gates[2:], raw=raw)
                report(f"{name} cuda fp32 decode vs C reference decode"
                       + (", gate and beta in kernel" if raw else ""), o, s, o_c, s_c,
                       checked=False)

    check_cuda()

    print("PASS" if failures == 0 else f"FAIL: {failures} comparison(s) over tolerance")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
