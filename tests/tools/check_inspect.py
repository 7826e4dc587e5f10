#!/usr/bin/env python3
"""`stepq inspect --json` on the bundled example maps gives the issue's exact numbers,
and an unreadable map gives an error message and exit status 1, not a crash."""
import glob
import json
import os
import subprocess
import sys
import tempfile

stepq, root = sys.argv[1], sys.argv[2]
ex = os.path.join(root, "config", "examples")

# (map file, key, expected) -- the paper's memory numbers, plus its analytical slot.
expect = [
    ("qwen3.8-27b.fp32.json", "state_bytes_fp32", 150994944),
    ("qwen3.8-27b.fp32.json", "conv_bytes", 2949120),
    ("qwen3.8-27b.dsq-6.json", "state_bytes_compact", 29491200),
    ("qwen3.8-27b.uniform-6.json", "state_bytes_compact", 28901376),
    ("qwen3.8-27b.stepq-6-layout.json", "state_bytes_compact", 29999104),
    ("qwen3.8-27b.stepq-6-layout.json", "state_bytes_allocated", 30015488),
    ("kimi-linear-48b-a3b.fp32.json", "state_bytes_fp32", 41943040),
    ("kimi-linear-48b-a3b.dsq-4.json", "state_bytes_compact", 5570560),
    # fp8: 1 B per value + 4 fp32 tile scales per 128x128 head, no alignment padding
    ("qwen3-next-80b-a3b.fp8.json", "state_bytes_compact", 1152 * (16384 + 16)),
    ("qwen3-next-80b-a3b.fp8.json", "state_bytes_allocated", 1152 * (16384 + 16)),
    ("kimi-linear-48b-a3b.fp8.json", "state_bytes_compact", 640 * (16384 + 16)),
]
failed = 0
cache = {}
for name, key, want in expect:
    if name not in cache:
        out = subprocess.run([stepq, "inspect", os.path.join(ex, name), "--json"],
                             capture_output=True, text=True, check=True).stdout
        cache[name] = json.loads(out)
    got = cache[name][key]
    ok = got == want
    failed += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name} {key} = {got} (want {want})")

# Ratio and bits per value are consistent with the byte counts.
d = cache["qwen3.8-27b.stepq-6-layout.json"]
if abs(d["ratio_vs_fp32"] - 150994944 / 29999104) > 1e-5 or abs(d["bits_per_value"] - 29999104 * 8 / (150994944 / 4)) > 1e-5:
    print("FAIL ratio/bits inconsistent:", d)
    failed += 1

# fp8's bits per value: 8 + 32 * 4 / (128 * 128) = 8.0078125 (printed to 6 decimals).
d = cache["qwen3-next-80b-a3b.fp8.json"]
if abs(d["bits_per_value"] - (8 + 1 / 128)) > 1e-6 or d["method"] != "fp8" or d["pivots"] != 0:
    print("FAIL fp8 bits per value:", d)
    failed += 1

# Every calibrated map in the repository loads and is within its nominal budget
# (pivots counted as 8-bit units; the fp16 they really store adds 8 bits per pivot value).
calibrated = sorted(glob.glob(os.path.join(root, "config", "calibrated", "*", "*.json")))
for path in calibrated:
    r = subprocess.run([stepq, "inspect", path, "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        print("FAIL", path, r.stderr.strip())
        failed += 1
        continue
    d = json.loads(r.stdout)
    print(f"ok   {os.path.relpath(path, root)}: {d['method']} {d['bits_per_value']:.3f} bits/value")

# Bad input: a clear message and status 1.
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    f.write('{"format": "stepq-precision-map", "schema_version": 1, "model": 7}')
bad = subprocess.run([stepq, "inspect", f.name], capture_output=True, text=True)
os.unlink(f.name)
if bad.returncode != 1 or "model" not in bad.stderr:
    print("FAIL bad map: rc", bad.returncode, "stderr", bad.stderr)
    failed += 1
else:
    print("ok   bad map ->", bad.stderr.strip())
missing = subprocess.run([stepq, "inspect", "/nonexistent/map.json"], capture_output=True, text=True)
if missing.returncode != 1 or not missing.stderr:
    print("FAIL missing file: rc", missing.returncode)
    failed += 1
# --tp N: each GPU's heads and page, padded to the largest, and the padding per GPU and replica.
tp_checks = 0
m27 = os.path.join(ex, "qwen3.8-27b.stepq-6-layout.json")
whole = json.loads(subprocess.run([stepq, "inspect", m27, "--json"], capture_output=True,
                                  text=True, check=True).stdout)
for tp in (1, 2, 4, 8):
    d = json.loads(subprocess.run([stepq, "inspect", m27, "--json", "--tp", str(tp)],
                                  capture_output=True, text=True, check=True).stdout)
    t, ranks = d["tp"], d["tp"]["ranks"]
    ok = (t["size"] == tp and len(ranks) == tp and
          [r["first_v_head"] for r in ranks] == [48 // tp * r for r in range(tp)] and
          all(r["v_heads"] == 48 // tp and r["k_heads"] == 16 // tp for r in ranks) and
          sum(r["state_bytes"] for r in ranks) == whole["state_bytes_allocated"] and
          all(r["conv_bytes"] == 2949120 // tp for r in ranks) and
          all(r["own_page_bytes"] + r["tp_pad_bytes"] == t["page_bytes_per_gpu"] for r in ranks) and
          ranks[t["largest_rank"]]["tp_pad_bytes"] == 0 and
          sum(r["tp_pad_bytes"] for r in ranks) == t["tp_pad_bytes_per_replica"] and
          t["page_bytes_per_replica"] == tp * t["page_bytes_per_gpu"] and
          {k: v for k, v in d.items() if k != "tp"} == whole)
    failed += not ok
    tp_checks += 1
    print(f"{'ok  ' if ok else 'FAIL'} inspect --tp {tp}: page {t['page_bytes_per_gpu']} B per GPU, "
          f"TP padding {t['tp_pad_bytes_per_replica']} B per replica")
text = subprocess.run([stepq, "inspect", m27, "--tp", "4"], capture_output=True, text=True).stdout
ok = ("TP padding B per GPU" in text and "page per GPU" in text and
      "page per replica     33619968 B" in text and "(TP padding 655360 B, 4 GPUs)" in text)
failed += not ok
tp_checks += 1
print(f"{'ok  ' if ok else 'FAIL'} inspect --tp 4 text labels the padding per GPU and per replica")
bad = subprocess.run([stepq, "inspect", m27, "--tp", "5"], capture_output=True, text=True)
ok = (bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.splitlines()) == 1 and
      "--tp 5" in bad.stderr and "num_k_heads 16" in bad.stderr and "tp_size 5" in bad.stderr)
failed += not ok
tp_checks += 1
print(f"{'ok  ' if ok else 'FAIL'} inspect --tp 5 -> {bad.stderr.strip()}")
print(f"{len(expect) + len(calibrated) + 3 + tp_checks - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
