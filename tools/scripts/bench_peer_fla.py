#!/usr/bin/env python3
"""Times flash-linear-attention's fp32-state decode kernels as the peer column of
`stepq bench kernels`, on the same shapes and with the same timing rules:
one layer, one token per request (T = 1), CUDA events, 3 warm-ups, median of 20.

  python3 tools/scripts/bench_peer_fla.py --fla peers/fla [--json FILE] [--batch B ...]

--fla names a folder holding the `fla` package (a snapshot of
github.com/fla-org/flash-linear-attention, kept in the ignored peers/ folder; it is
never part of stepq). Needs torch, triton, einops and transformers (all on the GPU
host's image).

Shapes (as tools/bench_kernels.c): Qwen3-Next-80B-A3B GDN layer at TP1 (H = 16 q/k
heads, HV = 32 value heads, 128 x 128 state) through `fused_recurrent_gated_delta_rule`
with in-kernel q/k l2norm; Kimi-Linear-48B KDA layer (H = HV = 32, per-key-row gate)
through `fused_recurrent_kda`. The state is read from one fp32 [B, HV, K, V] tensor
and the final state written to another (output_final_state=True), so the bytes
moved are 2 x 4 x B x HV x K x V plus q/k/v/g/beta/out, the same count as stepq's
fp32 row.
"""
import argparse
import json
import statistics
import sys


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fla", required=True, help="folder that contains the fla package")
    p.add_argument("--batch", type=int, action="append", help="batch sizes (default 1..512)")
    p.add_argument("--shape", choices=["gdn", "kda", "both"], default="both")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json", help="write the rows here")
    return p.parse_args()


def copy_bandwidth(torch):
    """Device-to-device copy of 2 GiB, read + write bytes over the median time."""
    n = 1 << 29  # floats
    a = torch.empty(n, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ts = time_it(torch, lambda: b.copy_(a), 20)
    return 2 * 4 * n / (ts * 1e-6) / 1e9


def time_it(torch, fn, runs):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000.0)  # us
    return statistics.median(times)


def main():
    a = parse_args()
    sys.path.insert(0, a.fla)
    import torch
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.kda import fused_recurrent_kda

    if not torch.cuda.is_available():
        print("bench_peer_fla: no CUDA device", file=sys.stderr)
        return 77
    torch.manual_seed(0)
    batches = a.batch or [1, 8, 32, 64, 128, 256, 512]
    bw = copy_bandwidth(torch)
    print("device: %s; copy bandwidth (D2D, read+write) %.0f GB/s" % (torch.cuda.get_device_name(), bw))
    print("timing: CUDA events, 3 warm-up, median of %d; one layer, T = 1; fla from %s" % (a.runs, a.fla))
    rows = []
    shapes = [("gdn", 16, 32), ("kda", 32, 32)]
    for name, H, HV in shapes:
        if a.shape not in (name, "both"):
            continue
        K = V = 128
        print("\n%s (H=%d, HV=%d)" % ("Qwen3-Next-80B-A3B GDN" if name == "gdn" else "Kimi-Linear-48B KDA", H, HV))
        print("%-10s %6s %10s %12s %8s %6s" % ("peer", "B", "us", "bytes", "GB/s", "copy%"))
        for B in batches:
            dev = "cuda"
            q = torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, 1, HV, V, device=dev, dtype=torch.bfloat16)
            beta = torch.rand(B, 1, HV, device=dev, dtype=torch.bfloat16)
            h0 = torch.randn(B, HV, K, V, device=dev, dtype=torch.float32) * 0.01
            if name == "gdn":
                g = -torch.rand(B, 1, HV, device=dev, dtype=torch.float32) * 0.1

                def fn():
                    return fused_recurrent_gated_delta_rule(
                        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
            else:
                g = -torch.rand(B, 1, HV, K, device=dev, dtype=torch.float32) * 0.1

                def fn():
                    return fused_recurrent_kda(
                        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
            us = time_it(torch, fn, a.runs)
            state = 2 * 4 * B * HV * K * V
            io = (q.numel() + k.numel() + v.numel() + beta.numel()) * 2 + g.numel() * 4 + B * HV * V * 2
            nbytes = state + io
            gbs = nbytes / (us * 1e-6) / 1e9
            print("%-10s %6d %10.1f %12d %8.0f %5.1f%%" % (name, B, us, nbytes, gbs, 100.0 * gbs / bw))
            rows.append({"shape": name, "batch": B, "us": us, "bytes": nbytes, "gbs": gbs,
                         "copy_fraction": gbs / bw})
            del q, k, v, beta, h0, g
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
