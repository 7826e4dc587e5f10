#!/usr/bin/env python3
"""tools/scripts/ncu_phases.py on a hand-made ncu source CSV: phases end at BAR (not DEPBAR),
instructions per warp divide by the first instruction's count (or --warps), sample shares, named
groups, JSON; and one-line errors for a missing file, a CSV without ncu's columns, a bad group."""
import json
import os
import subprocess
import sys
import tempfile

root = sys.argv[1]
script = os.path.join(root, "tools", "scripts", "ncu_phases.py")
HDR = ('"Address","Source","Warp Stall Sampling (All Samples)",'
       '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed"')
ROWS = [  # address, source, samples, not issued, executed (4 warps)
    ("0x10", "LDC R1, c[0x0][0x28]", 2, 1, 4),
    ("0x20", "LDG.E R2, [R4.64]", 10, 4, 4),
    ("0x30", "LDGDEPBAR", 1, 0, 4),          # not a block barrier
    ("0x40", "BAR.SYNC.DEFER_BLOCKING 0x0", 7, 3, 4),
    ("0x50", "HFMA2 R3, R2, R2, R3", 3, 1, 8),
    ("0x60", "@!P0 BRA 0x90", 0, 0, 4),
    ("0x70", "HFMA2 R5, R3, R3, R5", 0, 0, 0),  # never executed: skipped
    ("0x80", "@P1 BAR.RED.OR.DEFER_BLOCKING 0x0, P0", 5, 2, 4),
    ("0x90", "EXIT", 2, 1, 4),
]
bad = 0


def run(args):
    return subprocess.run([sys.executable, script] + args, capture_output=True, text=True)


with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "k.csv")
    with open(path, "w") as f:
        f.write('"Kernel Name","void k(int)",\n' + HDR + "\n")
        for r in ROWS:
            f.write('"%s","      %s","%d","%d","%d"\n' % r)
    out = os.path.join(d, "k.json")
    p = run([path, "--json", out, "--groups", "head=0;rest=1-2"])
    ok = p.returncode == 0 and p.stderr == ""
    res = json.load(open(out)) if ok else {}
    ph = res.get("phases", [])
    ok = ok and res["warps"] == 4 and len(ph) == 3 and res["samples"] == 30
    ok = ok and abs(ph[0]["instructions_per_warp"] - 4.0) < 1e-12  # LDC LDG LDGDEPBAR BAR
    ok = ok and abs(ph[1]["instructions_per_warp"] - 4.0) < 1e-12  # HFMA2 x2, BRA, BAR.RED
    ok = ok and abs(ph[2]["instructions_per_warp"] - 1.0) < 1e-12  # EXIT
    ok = ok and abs(ph[0]["samples_share"] - 20 / 30) < 1e-12 and abs(ph[1]["not_issued_share"] - 3 / 12) < 1e-12
    ok = ok and ph[1]["top"][0] == ["HFMA2", 2.0] and ph[0]["barrier"].startswith("BAR.SYNC")
    g = {x["name"]: x for x in res.get("groups", [])}
    ok = ok and abs(g["head"]["instructions_per_warp"] - 4.0) < 1e-12 and g["rest"]["phases"] == [1, 2]
    ok = ok and "3 warps" not in p.stdout and "4 warps, 9.0 warp instructions per warp" in p.stdout
    q = run([path, "--warps", "2"])
    ok = ok and q.returncode == 0 and "2 warps, 18.0 warp instructions per warp" in q.stdout
    print("%s ncu_phases: phases at BAR only, per-warp counts, sample shares, groups, JSON"
          % ("ok  " if ok else "FAIL"))
    bad += not ok
    plain = os.path.join(d, "plain.csv")
    with open(plain, "w") as f:
        f.write("a,b\n1,2\n")
    ok = True
    for args, want in (([os.path.join(d, "none.csv")], "No such file"),
                       ([plain], "no header row"),
                       ([path, "--groups", "x=7"], "phase 7 of 'x=7' is not one of 0..2"),
                       ([path, "--groups", "x"], "is not NAME=PHASES"),
                       ([path, "--warps", "0"], "--warps: 0")):
        r = run(args)
        ok = ok and r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1
        ok = ok and r.stdout == ""
    print("%s ncu_phases: one-line errors (missing file, not ncu's CSV, bad groups, bad --warps)"
          % ("ok  " if ok else "FAIL"))
    bad += not ok
    h = run(["--help"])
    ok = h.returncode == 0 and "--groups" in h.stdout
    print("%s ncu_phases --help" % ("ok  " if ok else "FAIL"))
    bad += not ok
sys.exit(1 if bad else 0)
