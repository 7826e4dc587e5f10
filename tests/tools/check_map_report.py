#!/usr/bin/env python3
"""map_report.py reads a calibrated map as it reads a calibrate report: on tiny-kda's committed
stepq@4 map it gives the width histogram, the half-life bands and the pivot rows that
tools/results/tiny-kda-test/bits-pivots.md holds (made from the calibration's report), and it
refuses a map without units by name. Usage: check_map_report.py ROOT"""
import os
import subprocess
import sys


def main():
    root = sys.argv[1]
    script = os.path.join(root, "tools", "scripts", "map_report.py")
    kda = os.path.join(root, "config", "calibrated", "tiny-kda")
    with open(os.path.join(root, "tools", "results", "tiny-kda-test", "bits-pivots.md")) as f:
        want = f.read().split("### ")[1]  # the stepq@4 section, from the report
    r = subprocess.run([sys.executable, script, "stepq@4=" + os.path.join(kda, "stepq@4.json"), "--pivots", "40"],
                       capture_output=True, text=True, timeout=60)
    fails = 0
    got = r.stdout.split("### ")[1] if "### " in r.stdout else ""
    if r.returncode != 0 or got.strip() != want.strip():
        print("FAIL: the map's table differs from the report's:\n" + got[:2000])
        fails += 1
    else:
        print("ok   tiny-kda stepq@4: the map gives the report's widths, bands and pivot rows")
    r = subprocess.run([sys.executable, script, "x=" + os.path.join(kda, "fp32.json")],
                       capture_output=True, text=True, timeout=60)
    if r.returncode == 0 or "fp32 map has no per-unit widths" not in r.stderr:
        print("FAIL: an fp32 map: rc %d, %s" % (r.returncode, r.stderr.strip()[-200:]))
        fails += 1
    else:
        print("ok   an fp32 map is refused: " + r.stderr.strip())
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
