#!/usr/bin/env python3
"""stepq bench decode with several maps of one model shape (host backend, reduced runs):
  - a preset at --bits 6,4: rows fp32, bf16, stepq@6, stepq@4 in that order per batch, every
    map in --json's states (with its source) and maps (preset_bits 6 and 4), one line per map
    in the memory table and a row per map in the batch table; stepq@4 smaller than stepq@6;
    the rows the one-map run has (fp32, bf16, stepq@6) give that run's outputs and bytes;
  - a map file next to the preset at the same width: both labels get their names, and the file
    `stepq mkmap --shape PRESET --method stepq --bits 4 --pivots P` writes (P one unit in 72)
    has the preset's bytes and outputs;
  - an fp32 map is timed as the fp32 rows (no row of its own, maps[].own_rows false);
  - progress counts every row's request tokens;
  - --tp 2 --procs: every rank times every map, the slowest rank's time per row; --peer: a
    "vs peer" for every row;
  - refused in one line before any work, nothing on stdout: maps of other shapes (naming both
    and the field), --bits without a PRESET, bad --bits, a target twice, too many maps.
Usage: check_bench_decode_maps.py STEPQ_EXE SOURCE_ROOT"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_checks import bench, check, failed  # noqa: E402
import tempfile

EXE, ROOT = sys.argv[1], sys.argv[2]
PRESET = "qwen3-next-80b-a3b"
EX = os.path.join(ROOT, "config", "examples")
ENV = dict(os.environ, STEPQ_PROGRESS="off")
SMALL = ["--backend", "host", "--layers", "1", "--batch", "1", "--tokens", "2"]
LABEL = "fla fp32 (peer)"


def run(args, env=ENV):
    return bench(EXE, args, env)



def doc(args):
    p = run(args + ["--json"])
    try:
        return json.loads(p.stdout), p
    except ValueError:
        return None, p


def labels(d):
    return [[r["label"] for r in b["rows"]] for b in d["batches"]]


def by_label(d):
    return {r["label"]: r for b in d["batches"] for r in b["rows"]}


def two_widths():
    d, p = doc([PRESET, "--bits", "6,4"] + SMALL)
    want = ["fp32", "bf16", "stepq@6", "stepq@4"]
    try:
        st = {s["label"]: s for s in d["states"]}
        ok = (p.returncode == 0 and labels(d) == [want] and [s["label"] for s in d["states"]] == want
              and d["preset"] == PRESET and
              [(m["source"], m["kind"], m["preset_bits"], m["label"], m["own_rows"])
               for m in d["maps"]] == [(PRESET, "preset", 6, "stepq@6", True),
                                       (PRESET, "preset", 4, "stepq@4", True)] and
              st["stepq@6"]["source"] == st["stepq@4"]["source"] == PRESET and
              "source" not in st["fp32"] and st["stepq@4"]["bits"] == 4 and
              st["stepq@4"]["state_bytes_per_request"] < st["stepq@6"]["state_bytes_per_request"] and
              all(r["ran"] and r["output_checksum"] > 0 and "speedup_vs_fp32" in r and
                  "reserved_pool_bytes" in r for r in by_label(d).values()) and
              all(k in st["stepq@4"] for k in ("method", "state_bytes_per_request", "slot_bytes",
                                               "max_batch", "conv_bytes_per_request")))
    except (TypeError, KeyError) as e:
        print(e)
        ok = False
    check(ok, "bench decode %s --bits 6,4 --json: fp32, bf16, stepq@6, stepq@4 rows, states and "
          "maps" % PRESET, p.stdout[:600] + p.stderr)
    if not ok:
        return
    # The rows of the one-map run: the same bytes and outputs (the same inputs for every row).
    one, q = doc([PRESET] + SMALL)
    try:
        a, b = by_label(one), by_label(d)
        ok = (q.returncode == 0 and labels(one) == [want[:3]] and
              all(a[k]["output_checksum"] == b[k]["output_checksum"] and
                  a[k]["state_bytes"] == b[k]["state_bytes"] for k in want[:3]) and
              one["states"] == d["states"][:3])
    except (TypeError, KeyError):
        ok = False
    check(ok, "bench decode %s --bits 6,4: its fp32, bf16 and stepq@6 rows are the one-map "
          "run's" % PRESET, q.stderr)

    # The table: a memory line and a batch row per map.
    p = run([PRESET, "--bits", "6,4"] + SMALL)
    mem = [l.split()[0] for l in p.stdout.splitlines() if l.startswith("  ") and l.split() and
           l.split()[0] in want]
    rows = [l.split()[1] for l in p.stdout.splitlines()
            if l.split()[:1] == ["1"] and l.split()[-1] in ("yes", "no")]
    check(p.returncode == 0 and mem == want and rows == want and
          "its stepq@4 layout map" in p.stdout and "its stepq@6 layout map" in p.stdout,
          "bench decode --bits 6,4 table: a memory line and a batch row per map", p.stdout)

    # Progress: 4 rows x batches 1 and 3 x 3 tokens x (1 warm-up + 3 runs) = 192 request tokens.
    p = run([PRESET, "--bits", "6,4", "--backend", "host", "--layers", "1", "--batch", "1,3",
             "--tokens", "3"], env=dict(ENV, STEPQ_PROGRESS="lines", STEPQ_PROGRESS_INTERVAL="0"))
    lines = p.stderr.strip().splitlines()
    check(p.returncode == 0 and lines and
          lines[-1].startswith("stepq bench decode: 192/192 tokens done"),
          "bench decode --bits 6,4 progress: every row's request tokens", p.stderr[-300:])


def with_file(d):
    # The preset's stepq@4 as mkmap writes it (pivots one unit in 72: 36 layers x 32 heads / 72).
    path = os.path.join(d, "next-stepq-4.json")
    m = subprocess.run([EXE, "mkmap", "--shape", PRESET, "--method", "stepq", "--bits", "4",
                        "--pivots", str((36 * 32 + 36) // 72), "--out", path],
                       capture_output=True, text=True)
    check(m.returncode == 0, "stepq mkmap %s stepq@4" % PRESET, m.stderr)
    j, p = doc([PRESET, "--bits", "4", path] + SMALL)
    a, b = "stepq@4 (%s)" % PRESET, "stepq@4 (next-stepq-4.json)"
    try:
        r, st = by_label(j), {s["label"]: s for s in j["states"]}
        ok = (p.returncode == 0 and labels(j) == [["fp32", "bf16", a, b]] and
              r[a]["output_checksum"] == r[b]["output_checksum"] and
              st[a]["state_bytes_per_request"] == st[b]["state_bytes_per_request"] and
              st[b]["source"] == path and [m["label"] for m in j["maps"]] == [a, b])
    except (TypeError, KeyError) as e:
        print(e)
        ok = False
    check(ok, "bench decode PRESET --bits 4 + its mkmap file: named labels, the same state",
          p.stdout[:600] + p.stderr)

    # An fp32 map: the fp32 rows are its.
    fp32 = os.path.join(EX, PRESET + ".fp32.json")
    j, p = doc([PRESET, fp32] + SMALL)
    try:
        ok = (p.returncode == 0 and labels(j) == [["fp32", "bf16", "stepq@6"]] and
              [(m["label"], m["own_rows"]) for m in j["maps"]] == [("stepq@6", True),
                                                                 ("fp32", False)])
    except (TypeError, KeyError):
        ok = False
    check(ok, "bench decode PRESET + an fp32 map: timed as the fp32 rows", p.stdout[:400] + p.stderr)

    # --tp 2 --procs: each rank times every map; --peer: vs peer on every row.
    peer = os.path.join(d, "peer.json")
    with open(peer, "w") as f:
        json.dump({"format": "stepq-bench-decode-peer", "version": 1, "device": "NVIDIA H200",
                   "shape": {"arch": "gdn", "num_k_heads": 8, "num_v_heads": 16,
                             "head_k_dim": 128, "head_v_dim": 128, "layers": 1},
                   "tokens": 2, "dtype": "bf16", "batches": [{"batch": 1, "decode_s": 0.01}]}, f)
    j, p = doc([PRESET, "--bits", "6,4", "--tp", "2", "--procs", "--peer", peer] + SMALL)
    want = ["fp32", "bf16", "stepq@6", "stepq@4"]
    try:
        rows = j["batches"][0]["rows"]
        ok = (p.returncode == 0 and [r["label"] for r in rows] == want + [LABEL] and
              all([s["label"] for s in k["states"]] == want for k in j["ranks"]) and
              all(r["decode_s"] == max(r["decode_s_per_rank"]) and r["speedup_vs_peer"] > 0
                  for r in rows[:4]) and [m["label"] for m in j["maps"]] == want[2:])
    except (TypeError, KeyError, IndexError) as e:
        print(e)
        ok = False
    check(ok, "bench decode --bits 6,4 --tp 2 --procs --peer: every map on every rank, vs peer",
          p.stdout[-600:] + p.stderr)


def refusals():
    kda = os.path.join(EX, "kimi-linear-48b-a3b.fp32.json")
    gdn27 = os.path.join(EX, "qwen3.8-27b.stepq-6-layout.json")
    u4 = os.path.join(EX, PRESET + ".uniform-4.json")
    cases = [
        ([PRESET, kda], "%s and %s differ in arch (gdn vs kda)" % (PRESET, kda)),
        ([gdn27, PRESET, "--bits", "4"], "%s and %s differ in recurrent layers (48 vs 36)" %
         (gdn27, PRESET)),
        ([u4, "--bits", "6,4"], "--bits 6,4: the widths of a PRESET's stepq layout map, and no "
                                "PRESET is given"),
        ([PRESET, "--bits", "6,6"], "--bits '6,6'"),
        ([PRESET, "--bits", "2"], "--bits '2'"),
        ([PRESET, "--bits", "6,x"], "--bits '6,x'"),
        ([PRESET, u4, PRESET], "'%s' given twice" % PRESET),
        ([PRESET, "--bits", "3,4,5,6,8", u4, os.path.join(EX, PRESET + ".uniform-6.json"),
          os.path.join(EX, PRESET + ".uniform-8.json"), os.path.join(EX, PRESET + ".fp8.json")],
         "--bits 3,4,5,6,8: 9 maps"),
    ]
    for args, want in cases:
        p = run(args + SMALL, env=dict(ENV, STEPQ_PROGRESS="lines", STEPQ_PROGRESS_INTERVAL="0"))
        lines = p.stderr.strip().splitlines()
        check(p.returncode == 2 and len(lines) == 1 and want in lines[0] and p.stdout == "",
              "bench decode %s: refused in one line before any work" %
              " ".join(os.path.basename(a) for a in args), "rc %d, %r" % (p.returncode, p.stderr))


def main():
    two_widths()
    with tempfile.TemporaryDirectory() as d:
        with_file(d)
    refusals()
    return 1 if failed() else 0


if __name__ == "__main__":
    sys.exit(main())
