#!/usr/bin/env python3
"""Times flash-linear-attention's fp32-state decode kernels as the peer of stepq's benches,
in a process of its own (fla is never part of stepq).

Kernels mode, the peer column of `stepq bench kernels --peer FILE`: one layer, one token per
request (T = 1), CUDA events, 3 warm-ups, median of 20.

  python3 tools/scripts/bench_peer_fla.py --fla peers/fla [--json FILE] [--batch B ...]

Decode mode, the "fla fp32 (peer)" row of `stepq bench decode --peer FILE`: bench decode's
protocol on the peer for one model shape (a bench decode preset, a map file, or --heads):

  python3 tools/scripts/bench_peer_fla.py --fla peers/fla --decode PRESET|MAP \\
      [--layers N] [--batch 32,64,128,256,512] [--tokens 1024] [--runs 3] [--warmup 1] \\
      [--dtype bf16|fp32] --json FILE
  python3 tools/scripts/bench_peer_fla.py --fla peers/fla --heads H,HV,LAYERS,gdn|kda ...

Every timed layer has its own fp32 [B, HV, K, V] state tensor, which each token's step reads
and replaces: per token, every layer's one-token step (T = 1) with q, k, v, g and beta in
--dtype (bf16 as bench decode's default: as servers hold them), unit-norm q and k, q/k l2norm in
the kernel (bench decode's STEPQ_STEP_L2NORM), scale K^-1/2, beta in [0.2, 0.8), log-space gates
from half-lives log-uniform in [2, 2048] tokens, +-50% per request (the values do not change
the kernels' work), the inputs cycling through 4 sets as bench decode's (token t, layer l:
set (t + l) mod 4). GDN: `fused_recurrent_gated_delta_rule(..., initial_state=S[l],
output_final_state=True)`, the returned state becoming S[l] (fla's GDN kernel has no in-place
option; the old tensor goes back to torch's caching allocator, no cudaMalloc in the loop).
KDA: `fused_recurrent_kda_fwd(..., initial_state=S[l], inplace_final_state=True, out=o)`, in
place as vLLM's decode calls it. Launches are eager, one call at a time (bench decode without
--graph). Each run starts from the same prompt state (copied in, not timed); decode time = the
sum of the CUDA-event intervals between consecutive token starts and an end mark (the gaps
included); 1 warm-up + 3 runs, the median; tokens/s = B x T / decode time.

--fla names a folder holding the `fla` package (a snapshot of
github.com/fla-org/flash-linear-attention, kept in the ignored peers/ folder). Needs torch,
triton, einops and transformers (all on the GPU host's image); the arguments, the shapes and
--print-shape need none of them.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys

# Where a preset's shape comes from: `stepq mkmap --shape PRESET` (tools/mkmap.c's table, the
# one bench decode uses), run from --stepq, $STEPQ_EXE or the repository's build folders.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPQ_BUILDS = ("build-gpu", "build")
# bench decode's protocol (tools/bench_decode.c).
PAPER_BATCHES = [32, 64, 128, 256, 512]
PAPER_TOKENS = 1024
N_BANK = 4
HALF_LIFE_MIN, HALF_LIFE_MAX = 2.0, 2048.0
FORMAT = "stepq-bench-decode-peer"
LABEL = "fla fp32 (peer)"
# Of the device's free memory a batch may take (the rest: torch's and triton's own).
MEMORY_FRACTION = 0.9
# Where the tensors live (the stand-in test of tests/tools/check_bench_peer_fla.py: "cpu").
DEVICE = "cuda"


def fail(msg):
    """One line naming the bad option, exit status 2 (as stepq's tools)."""
    print("bench_peer_fla: %s" % msg, file=sys.stderr)
    sys.exit(2)


def batch_list(text):
    out = []
    for x in text.split(","):
        try:
            b = int(x)
        except ValueError:
            b = 0
        if not 1 <= b <= 65535:
            raise argparse.ArgumentTypeError("'%s': want batch sizes in [1, 65535], e.g. 32,64,128" % text)
        out.append(b)
    return out


class Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(message.replace("argument ", "", 1))


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fla", help="folder that contains the fla package (needed to time)")
    p.add_argument("--batch", type=batch_list, action="append",
                   help="batch sizes, comma-separated or repeated (default: kernels 1..512, "
                        "decode 32,64,128,256,512)")
    p.add_argument("--runs", type=int, help="timed runs (default: kernels 20, decode 3)")
    p.add_argument("--json", help="write the results here (whole or not at all)")
    k = p.add_argument_group("kernels mode")
    k.add_argument("--shape", choices=["gdn", "kda", "both"], help="default both")
    d = p.add_argument_group("decode mode (stepq bench decode --peer)")
    d.add_argument("--decode", metavar="PRESET|MAP",
                   help="a bench decode preset (`stepq mkmap --help` lists them) or a map file")
    d.add_argument("--stepq", metavar="EXE",
                   help="the stepq command that resolves a preset (default: $STEPQ_EXE, else "
                        "build-gpu/ or build/ of the repository)")
    d.add_argument("--heads", metavar="H,HV,LAYERS,ARCH",
                   help="the shape by hand (K = V = 128), e.g. 8,24,48,gdn for one rank of "
                        "qwen3.8-27b at --tp 2")
    d.add_argument("--layers", type=int, help="the first N recurrent layers (default all)")
    d.add_argument("--tokens", type=int, help="generated tokens per request (default %d)" % PAPER_TOKENS)
    d.add_argument("--warmup", type=int, help="untimed runs first (default 1)")
    d.add_argument("--warmup-tokens", type=int,
                   help="tokens of each warm-up run (default --tokens; the timed runs keep --tokens)")
    d.add_argument("--dtype", choices=["bf16", "fp32"], help="of q, k, v, g, beta, o (default bf16)")
    d.add_argument("--print-shape", action="store_true",
                   help="print the shape's JSON and stop (no torch needed)")
    a = p.parse_args(argv)
    a.batch = [b for bs in a.batch for b in bs] if a.batch else None
    a.mode = "decode" if a.decode or a.heads else "kernels"
    if a.decode and a.heads:
        fail("--decode and --heads: want one of them")
    if a.mode == "kernels":
        for opt in ("layers", "tokens", "warmup", "warmup_tokens", "dtype"):
            if getattr(a, opt) is not None:
                fail("--%s is decode mode's: add --decode PRESET|MAP or --heads" % opt.replace("_", "-"))
        if a.print_shape:
            fail("--print-shape is decode mode's: add --decode PRESET|MAP or --heads")
        a.shape = a.shape or "both"
        a.runs = a.runs if a.runs is not None else 20
        if a.runs < 1:
            fail("--runs %d: want at least 1" % a.runs)
    else:
        if a.shape is not None:
            fail("--shape is kernels mode's: decode mode's shape is --decode or --heads")
        a.tokens = a.tokens if a.tokens is not None else PAPER_TOKENS
        a.runs = a.runs if a.runs is not None else 3
        a.warmup = a.warmup if a.warmup is not None else 1
        a.dtype = a.dtype or "bf16"
        a.batch = a.batch or PAPER_BATCHES
        if not 1 <= a.tokens <= 1 << 20:
            fail("--tokens %d: want an integer in [1, %d]" % (a.tokens, 1 << 20))
        if not 1 <= a.runs <= 100:
            fail("--runs %d: want an integer in [1, 100]" % a.runs)
        if not 0 <= a.warmup <= 100:
            fail("--warmup %d: want an integer in [0, 100]" % a.warmup)
        if a.warmup_tokens is not None and not 1 <= a.warmup_tokens <= 1 << 20:
            fail("--warmup-tokens %d: want an integer in [1, %d]" % (a.warmup_tokens, 1 << 20))
        a.warmup_tokens = min(a.warmup_tokens or a.tokens, a.tokens)
        if len(set(a.batch)) != len(a.batch):
            fail("--batch: a batch size twice")
        a.decode_shape = decode_shape(a)
    if not a.print_shape and not a.fla:
        fail("--fla: want the folder that holds the fla package (e.g. peers/fla)")
    return a


def preset_model(a):
    """The "model" section of `stepq mkmap --shape PRESET`'s map: the preset's shape exactly as
    bench decode builds it."""
    cands = [a.stepq, os.environ.get("STEPQ_EXE")] + [os.path.join(ROOT, b, "tools", "stepq")
                                                       for b in STEPQ_BUILDS]
    exe = next((c for c in cands if c and os.access(c, os.X_OK)), None)
    if not exe:
        fail("--decode '%s': a preset needs the stepq command (--stepq EXE or $STEPQ_EXE; none in "
             "%s of the repository), or give a map file" % (a.decode, " or ".join(STEPQ_BUILDS)))
    r = subprocess.run([exe, "mkmap", "--shape", a.decode, "--method", "fp32"], capture_output=True,
                       text=True)
    if r.returncode:
        fail("--decode '%s': not a preset nor a map file (%s)" % (a.decode, r.stderr.strip()))
    return json.loads(r.stdout)["model"]


def decode_shape(a):
    """The model shape decode mode times: a preset, a map's "model", or --heads."""
    if a.heads:
        f = a.heads.split(",")
        try:
            H, HV, L = (int(x) for x in f[:3])
        except ValueError:
            H = 0
        if len(f) != 4 or f[3] not in ("gdn", "kda") or H < 1 or HV < 1 or L < 1 or HV % H:
            fail("--heads '%s': want H,HV,LAYERS,gdn|kda with HV a multiple of H, e.g. 16,48,48,gdn"
                 % a.heads)
        shape = {"name": "heads %s" % a.heads, "model": "", "arch": f[3], "num_k_heads": H,
                 "num_v_heads": HV, "head_k_dim": 128, "head_v_dim": 128, "model_layers": L}
    else:
        try:
            if "/" in a.decode or a.decode.endswith(".json"):
                with open(a.decode) as f:
                    m = json.load(f)["model"]
            else:
                m = preset_model(a)
            shape = {"name": a.decode, "model": m.get("name", ""), "arch": m["arch"],
                     "num_k_heads": int(m["num_k_heads"]), "num_v_heads": int(m["num_v_heads"]),
                     "head_k_dim": int(m["head_k_dim"]), "head_v_dim": int(m["head_v_dim"]),
                     "model_layers": len(m["recurrent_layers"])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail("--decode %s: not a readable stepq map (%s)" % (a.decode, e))
        if shape["arch"] not in ("gdn", "kda"):
            fail("--decode %s: arch '%s': the peer has gdn and kda" % (a.decode, shape["arch"]))
    L = shape["model_layers"]
    if a.layers is not None and not 1 <= a.layers <= L:
        fail("--layers %d: the shape has %d recurrent layers" % (a.layers, L))
    shape["layers"] = a.layers or L
    return shape


def write_json(path, doc):
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


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


def copy_bandwidth(torch):
    """Device-to-device copy of 2 GiB, read + write bytes over the median time."""
    n = 1 << 29  # floats
    a = torch.empty(n, dtype=torch.float32, device=DEVICE)
    b = torch.empty_like(a)
    ts = time_it(torch, lambda: b.copy_(a), 20)
    return 2 * 4 * n / (ts * 1e-6) / 1e9


def kernels_main(a, torch):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.kda import fused_recurrent_kda

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
        write_json(a.json, {"device": torch.cuda.get_device_name(), "copy_gbs": bw, "rows": rows})
    return 0


def decode_inputs(torch, sh, B, dt):
    """bench decode's inputs: N_BANK sets of unit-norm q/k, v in [-1, 1), beta in [0.2, 0.8);
    per layer one log-space gate tensor (GDN [B,1,HV], KDA [B,1,HV,K])."""
    H, HV, K, V, L = (sh[x] for x in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "layers"))
    dev = DEVICE
    bank = []
    for _ in range(N_BANK):
        q = torch.nn.functional.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1)
        v = torch.rand(B, 1, HV, V, device=dev) * 2 - 1
        beta = 0.2 + 0.6 * torch.rand(B, 1, HV, device=dev)
        bank.append(tuple(x.to(dt).contiguous() for x in (q, k, v, beta)))
    gn = (K,) if sh["arch"] == "kda" else ()
    gates = []
    for _ in range(L):
        u = torch.rand((HV,) + gn, device=dev, dtype=torch.float64)
        hl = HALF_LIFE_MIN * (HALF_LIFE_MAX / HALF_LIFE_MIN) ** u
        g = math.log(0.5) / hl * (0.5 + torch.rand((B, 1, HV) + gn, device=dev, dtype=torch.float64))
        gates.append(g.to(dt).contiguous())
    return bank, gates


def decode_batch(torch, a, sh, B, step):
    """One batch: warm-up + runs of T tokens x every layer; the runs' decode seconds."""
    HV, K, V, L = (sh[x] for x in ("num_v_heads", "head_k_dim", "head_v_dim", "layers"))
    T = a.tokens
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    bank, gates = decode_inputs(torch, sh, B, dt)
    # A prompt state of a prompt's magnitude; each run starts from it.
    prompt = torch.randn(B, HV, K, V, device=DEVICE, dtype=torch.float32) * 0.05
    states = [torch.empty_like(prompt) for _ in range(L)]
    o = torch.empty(B, 1, HV, V, device=DEVICE, dtype=dt)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(T + 1)]
    run_s = []
    for run in range(a.warmup + a.runs):
        for s in states:
            s.copy_(prompt)
        torch.cuda.synchronize()
        T = a.warmup_tokens if run < a.warmup else a.tokens
        for t in range(T):
            ev[t].record()
            for l in range(L):
                q, k, v, beta = bank[(t + l) % N_BANK]
                states[l], out = step(q, k, v, gates[l], beta, states[l], o)
        ev[T].record()
        ev[T].synchronize()
        sec = sum(ev[t].elapsed_time(ev[t + 1]) for t in range(T)) * 1e-3
        if run >= a.warmup:
            run_s.append(sec)
    # What the last step wrote: the work was done (sum of |o|, as bench decode's checksum).
    checksum = float(out.float().abs().sum())
    del states, prompt, bank, gates, o, out
    torch.cuda.empty_cache()
    return run_s, checksum


def decode_main(a, torch):
    sh = a.decode_shape
    if sh["arch"] == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        kernel = "fused_recurrent_gated_delta_rule, its new state carried"

        def step(q, k, v, g, beta, S, o):
            return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=S,
                                                    output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)[::-1]
    else:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        kernel = "fused_recurrent_kda_fwd, the state in place"

        def step(q, k, v, g, beta, S, o):
            fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=S,
                                    inplace_final_state=True, use_qk_l2norm_in_kernel=True, out=o)
            return S, o
    try:
        import fla
        fla_version = getattr(fla, "__version__", "")
    except ImportError:
        fla_version = ""

    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    HV, K, V, L = (sh[x] for x in ("num_v_heads", "head_k_dim", "head_v_dim", "layers"))
    print("peer     %s: %s, fla %s from %s" % (LABEL, kernel, fla_version or "?", a.fla))
    print("shape    %s (%s, %d of %d recurrent layers, H=%d, HV=%d, %dx%d)" %
          (sh["name"], sh["arch"], L, sh["model_layers"], sh["num_k_heads"], HV, K, V))
    print("device   %s; CUDA events, eager launches; %s q, k, v, g, beta and o, fp32 states" %
          (device, a.dtype))
    wu = " (%d tokens)" % a.warmup_tokens if a.warmup and a.warmup_tokens < a.tokens else ""
    print("run      %d tokens, %d warm-up%s + %d runs, median\n" % (a.tokens, a.warmup, wu, a.runs))
    print("%6s  %-16s %12s %10s %12s" % ("batch", "state", "tokens/s", "ms/step", "state MiB"))
    rows = []
    for B in a.batch:
        state_b = B * HV * K * V * 4
        need = (L + 2) * state_b  # the layers' states, the prompt and GDN's new one
        free, _ = torch.cuda.mem_get_info()
        if need > MEMORY_FRACTION * free:
            print("bench_peer_fla: --batch %d: %d layers of fp32 state need %.1f GiB, more than "
                  "%.1f GiB free: not run" % (B, L, need / 2**30, MEMORY_FRACTION * free / 2**30),
                  file=sys.stderr)
            continue
        with torch.inference_mode():  # as a server decodes: no autograd bookkeeping per call
            run_s, checksum = decode_batch(torch, a, sh, B, step)
        med = statistics.median(run_s)
        tps = B * a.tokens / med
        print("%6d  %-16s %12.1f %10.3f %12.2f" % (B, LABEL, tps, 1e3 * med / a.tokens,
                                                  L * state_b / 2**20))
        rows.append({"batch": B, "decode_s": med, "run_s": run_s, "tokens_per_s": tps,
                     "ms_per_step": 1e3 * med / a.tokens, "transitions": B * a.tokens,
                     "output_checksum": checksum})
    if a.json:
        doc = {"format": FORMAT, "version": 1, "label": LABEL, "peer": "flash-linear-attention",
               "fla": a.fla, "fla_version": fla_version, "kernel": kernel, "device": device,
               "torch": torch.__version__,
               "measures": "recurrent-state path only: every timed layer's one-token step",
               "shape": sh, "tokens": a.tokens, "warmup": a.warmup,
               "warmup_tokens": a.warmup_tokens, "runs": a.runs,
               "dtype": a.dtype, "state_dtype": "fp32", "launch": "eager",
               "timing": "cuda events: sum of the intervals between consecutive token starts",
               "gates": "fallback half-lives (the values do not change the kernels' work)",
               "batches": rows}
        write_json(a.json, doc)
    return 0


def main():
    a = parse_args()
    if a.print_shape:
        print(json.dumps(a.decode_shape, indent=1))
        return 0
    if not os.path.isdir(os.path.join(a.fla, "fla")):
        fail("--fla %s: no fla package folder in it" % a.fla)
    sys.path.insert(0, a.fla)
    import torch

    if not torch.cuda.is_available():
        print("bench_peer_fla: no CUDA device", file=sys.stderr)
        return 77
    return decode_main(a, torch) if a.mode == "decode" else kernels_main(a, torch)


if __name__ == "__main__":
    sys.exit(main())
