#!/usr/bin/env python3
"""Checks `stepq capacity` against the paper's numbers (Figure 1a accounting).

usage: check_capacity.py STEPQ EXAMPLES_DIR [--plot]
With --plot it checks the PNG/SVG output instead (exit 77, skipped, when the
plotting python has no matplotlib).
"""
import json
import os
import subprocess
import sys
import tempfile

GIB = float(1 << 30)
MIB = float(1 << 20)


def run(stepq, *args, expect=0):
    p = subprocess.run([stepq, "capacity", *args], capture_output=True, text=True)
    if p.returncode != expect:
        sys.exit("stepq capacity %s: exit %d, expected %d\n%s%s"
                 % (" ".join(args), p.returncode, expect, p.stdout, p.stderr))
    return p


def capacity(stepq, *args):
    return json.loads(run(stepq, *args, "--json").stdout)


def check(cond, what):
    if not cond:
        sys.exit("FAILED: " + what)
    print("ok:", what)


def toy_map():
    """Two 128x128 value heads at stepq@6: head 0 at 4 bits, head 1 an fp16 pivot."""
    return {"format": "stepq-precision-map", "schema_version": 1,
            "model": {"arch": "gdn", "recurrent_layers": [0], "num_k_heads": 2,
                      "num_v_heads": 2, "head_k_dim": 128, "head_v_dim": 128,
                      "conv_state": {"shape": [64, 3], "dtype": "bf16"}},
            "method": "stepq", "budget_bits": 6,
            "layers": [{"layer": 0, "pivots": [1],
                        "heads": [{"bits": 4, "row_impact": [1] * 128},
                                  {"bits": 16, "row_impact": [1] * 128}]}]}


def numbers(stepq, ex):
    stepq6 = os.path.join(ex, "qwen3.8-27b.stepq-6-layout.json")
    fp32 = os.path.join(ex, "qwen3.8-27b.fp32.json")

    c = capacity(stepq, stepq6, "--batch", "1,8,64,512")
    rows = {r["batch"]: r for r in c["batches"]}
    for r in c["batches"]:
        for key in ("batch", "slots", "slot_bytes", "state_pool_bytes", "total_bytes"):
            check(key in r, "row for B=%d has %s" % (r["batch"], key))
    b64 = rows[64]
    check(c["policy"] == "extra_buffer" and c["policy_slots"] == 5, "five-slot policy by default")
    check(b64["slots"] == 321, "(5B+1) = 321 slots at B=64")
    check(c["slot_state_bytes"] == 30015488, "stepq@6 state incl. pivot scale slots 30,015,488 B")
    check(c["slot_state_compact_bytes"] == 29999104, "compact 29,999,104 B")
    check(c["slot_conv_bytes"] == 2949120, "conv 2,949,120 B")
    check(b64["slot_bytes"] / MIB == 31.4375, "slot 31.4375 MiB")
    check(round(b64["state_pool_bytes"] / GIB, 2) == 9.85, "9.85 GiB at B=64")
    check(round(b64["fp32_state_pool_bytes"] / GIB, 2) == 46.02, "FP32 46.02 GiB at B=64")
    check(c["fp32_slot_bytes"] / MIB == 146.8125, "FP32 slot 146.8125 MiB")
    check(rows[512]["state_pool_bytes"] == 2561 * 32964608, "B=512 is (5*512+1) slots")

    f = capacity(stepq, fp32, "--batch", "64")
    check(f["slot_bytes"] == 153944064 and f["batches"][0]["state_pool_bytes"] == 321 * 153944064,
          "the FP32 map's own slot is 146.8125 MiB")

    c = capacity(stepq, stepq6, "--batch", "10", "--policy", "no_buffer", "--slot", "compact",
                 "--weights-bytes", "1000", "--kv-bytes-per-token", "65536", "--context", "100")
    r = c["batches"][0]
    check(r["slots"] == 31, "no_buffer reserves 3B+1")
    check(r["slot_bytes"] == 29999104 + 2949120, "--slot compact is compact state + conv")
    check(r["total_bytes"] == 1000 + 31 * (29999104 + 2949120) + 65536 * 100 * 10,
          "total = weights + state pool + KV")

    c1 = capacity(stepq, stepq6, "--batch", "1")
    c4 = capacity(stepq, stepq6, "--batch", "1", "--tp", "4")
    check(c4["slot_bytes"] >= c1["slot_bytes"] and c4["slot_bytes"] % 4 == 0,
          "TP 4 pads every rank to the largest page (S grows, 4 equal pages)")
    check(c4["slot_state_bytes"] == c1["slot_state_bytes"], "TP 4 holds the same head blocks")
    check(c4["tp_page_bytes_per_gpu"] * 4 == c4["slot_bytes"], "--tp 4: S is 4 per-GPU pages")
    pads = c4["tp_pad_bytes_per_gpu"]
    check(len(pads) == 4 and pads[c4["tp_largest_rank"]] == 0 and
          sum(pads) == c4["tp_pad_bytes_per_replica"] <= c4["slot_pad_bytes"],
          "--tp 4: TP padding per GPU sums to the replica's, 0 on the largest rank")
    check(not any(k.startswith("tp_") for k in c1), "no TP fields without --tp")
    p = run(stepq, stepq6, "--tp", "3", expect=2)
    check(p.stderr.strip() == "stepq capacity: --tp 3: num_k_heads 16 does not split over "
          "tp_size 3 (every rank holds num_k_heads / tp_size whole q/k heads)",
          "--tp 3 on 16 q/k heads: one line naming both numbers")
    with tempfile.TemporaryDirectory() as d:
        toy = os.path.join(d, "toy.json")
        with open(toy, "w") as f:
            json.dump(toy_map(), f)
        c = capacity(stepq, toy, "--batch", "1", "--tp", "2")
        # tests/tp/test_shard.c computes these pages by hand: 8960 and 33536 B.
        check(c["tp_page_bytes_per_gpu"] == 33536 and c["slot_bytes"] == 2 * 33536 and
              c["tp_pad_bytes_per_gpu"] == [24576, 0] and c["tp_pad_bytes_per_replica"] == 24576,
              "the hand-computed toy: 33536 B per GPU, 24576 B of TP padding on rank 0")
        p = run(stepq, toy, "--batch", "1", "--tp", "2")
        check("TP pad  per GPU 24576 / 0 B (ranks 0..1); per replica 24576 B" in p.stdout,
              "the text labels the padding per GPU and per replica")

    run(stepq, stepq6, "--policy", "radix", expect=2)
    run(stepq, stepq6, "--kv-bytes-per-token", "5", expect=2)
    run(stepq, stepq6, "--batch", "0", expect=2)

    # Byte counts past 2^64 are refused in one line naming the options (they wrapped: the KV
    # cache of 2^32 B/token x 2^32 tokens printed as 0 GiB), exit 2; 2^63 still counts exactly.
    c = capacity(stepq, stepq6, "--batch", "1", "--kv-bytes-per-token", str(1 << 32), "--context",
                 str(1 << 31))
    check(c["batches"][0]["kv_bytes"] == float(1 << 63), "a KV cache of 2^63 B is counted")
    for kv, ctx, batch in ((1 << 32, 1 << 32, "1"), (65536, 1 << 32, "1,8,16777216")):
        p = run(stepq, stepq6, "--batch", batch, "--kv-bytes-per-token", str(kv), "--context",
                str(ctx), expect=2)
        want = "stepq capacity: --kv-bytes-per-token %d x --context %d x --batch %s is more than " \
               "2^64 bytes\n" % (kv, ctx, batch.split(",")[-1])
        check(p.stderr == want and p.stdout == "", "KV %d x %d x B=%s wraps: refused" % (kv, ctx, batch))
    with tempfile.TemporaryDirectory() as d:
        huge = os.path.join(d, "conv-4tib.json")  # one 4 TiB conv state: S = 2^42 B
        with open(huge, "w") as f:
            json.dump({"format": "stepq-precision-map", "schema_version": 1,
                       "model": {"arch": "gdn", "recurrent_layers": [0], "num_k_heads": 1,
                                 "num_v_heads": 1, "head_k_dim": 4, "head_v_dim": 4,
                                 "conv_state": {"shape": [1 << 20, 1 << 20], "dtype": "fp32"}},
                       "method": "fp32", "budget_bits": 32}, f)
        p = run(stepq, huge, "--batch", "1,8,16777216", expect=2)
        want = ("stepq capacity: --batch 16777216 with --policy extra_buffer: 83886081 slots x "
                "4398046511360 B (the map's slot) is more than 2^64 bytes\n")
        check(p.stderr == want and p.stdout == "", "a state pool past 2^64 B is refused")
    p = run(stepq, os.path.join(ex, "no-such-map.json"), expect=1)
    check("no-such-map" in p.stderr, "a missing map is named in the error")


def plot(stepq, ex):
    stepq6 = os.path.join(ex, "qwen3.8-27b.stepq-6-layout.json")
    with tempfile.TemporaryDirectory() as d:
        for ext, magic in (("png", b"\x89PNG"), ("svg", b"<?xml")):
            out = os.path.join(d, "capacity." + ext)
            p = subprocess.run([stepq, "capacity", stepq6, "--weights-bytes", "53791996928",
                                "--plot", out], capture_output=True, text=True)
            if p.returncode != 0 and "matplotlib" in p.stderr:
                print("skipped: the plotting python has no matplotlib\n" + p.stderr)
                sys.exit(77)
            check(p.returncode == 0, "--plot %s runs: %s" % (ext, p.stderr.strip()))
            with open(out, "rb") as f:
                head = f.read(64)
            check(head.startswith(magic) and os.path.getsize(out) > 1000,
                  "a %s file is written" % ext)
        env = dict(os.environ, STEPQ_PLOT_SCRIPT=os.path.join(d, "missing.py"))
        p = subprocess.run([stepq, "capacity", stepq6, "--plot", os.path.join(d, "x.png")],
                           capture_output=True, text=True, env=env)
        check(p.returncode == 1, "a failing plotter fails the command")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[3] == "--plot":
        plot(sys.argv[1], sys.argv[2])
    else:
        numbers(sys.argv[1], sys.argv[2])
