#!/usr/bin/env python3
"""Where a CUDA kernel's instructions and time go, phase by phase, from ncu's source page.

Input: the CSV that `ncu -i REPORT --page source --csv --print-source sass` prints for one
kernel (the report collected with `--section SourceCounters`): a "Kernel Name" line, a header
with "Address", "Source", "Instructions Executed" and "Warp Stall Sampling (All Samples)", and
one row per SASS instruction in address order.

A phase is the run of executed instructions up to and including the next barrier (BAR.SYNC,
BAR.RED, ... : every opcode starting with BAR), in address order; for a kernel whose body is
straight-line code between __syncthreads (the stepq tile and fp16 kernels), phase k is the code
between barrier k-1 and barrier k. Per phase: warp instructions per warp (executed count divided
by the warps launched: --warps, or by default the execution count of the kernel's first
instruction, which every warp runs), the share of the warp-stall samples (ncu samples a warp's
whole residency, so this is where warps spend their lives), the share of the not-issued samples,
and the largest opcodes. --groups sums phases into named parts ("name=0,10,20;other=1-3").

Output: a table on stdout; --json FILE (or - for stdout, the table then goes to stderr) writes
{"warps", "instructions_per_warp", "samples", "phases": [...], "groups": [...]}.

Used for kernels/cuda/README.md's "The fp16 step, session 14" table:
  ncu --clock-control none --kernel-name regex:sq_f16 --launch-skip 2 --launch-count 1 \\
      --section SourceCounters -o f16 stepq bench kernels --only "stepq@6 fp16" --batch 512 --shape gdn
  ncu -i f16.ncu-rep --page source --csv --print-source sass > f16.csv
  python3 tools/scripts/ncu_phases.py f16.csv
"""
import argparse
import collections
import csv
import json
import sys

COLS = ("Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)")
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"


class Bad(Exception):
    pass


def opcode(src):
    """The opcode of a SASS line without its predicate and modifiers: '@!P0 BAR.SYNC 0x0' -> BAR."""
    parts = src.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def read_rows(path):
    try:
        f = sys.stdin if path == "-" else open(path, newline="")
    except OSError as e:
        raise Bad("%s: %s" % (path, e.strerror))
    with f:
        rows = list(csv.reader(f))
    hdr_i = next((i for i, r in enumerate(rows[:5]) if "Address" in r), None)
    if hdr_i is None:
        raise Bad("%s: no header row with an \"Address\" column in its first 5 lines (not ncu's "
                  "--page source --csv output?)" % path)
    hdr = rows[hdr_i]
    missing = [c for c in COLS if c not in hdr]
    if missing:
        raise Bad("%s: no column %s (collect the report with --section SourceCounters)"
                  % (path, ", ".join('"%s"' % c for c in missing)))
    ia, isrc, ie, iss = (hdr.index(c) for c in COLS)
    ini = hdr.index(NOT_ISSUED) if NOT_ISSUED in hdr else None
    out = []
    for n, r in enumerate(rows[hdr_i + 1:], hdr_i + 2):
        if len(r) <= max(ia, isrc, ie, iss) or not r[ie].strip():
            continue
        try:
            e = int(r[ie].replace(",", ""))
            s = int(r[iss].replace(",", "") or 0)
            ni = int(r[ini].replace(",", "") or 0) if ini is not None and len(r) > ini else 0
        except ValueError:
            raise Bad("%s:%d: a count that is not an integer" % (path, n))
        out.append((r[ia], r[isrc].strip(), e, s, ni))
    if not out:
        raise Bad("%s: no instruction rows" % path)
    return out


def parse_groups(text, n_phases):
    groups = []
    for part in text.split(";"):
        if not part.strip():
            continue
        if "=" not in part:
            raise Bad("--groups: '%s' is not NAME=PHASES" % part)
        name, spec = part.split("=", 1)
        phases = set()
        for item in spec.split(","):
            item = item.strip()
            try:
                if "-" in item:
                    a, b = item.split("-", 1)
                    phases.update(range(int(a), int(b) + 1))
                else:
                    phases.add(int(item))
            except ValueError:
                raise Bad("--groups: '%s' in '%s' is not a phase or a range a-b" % (item, part))
        bad = sorted(p for p in phases if p < 0 or p >= n_phases)
        if bad:
            raise Bad("--groups: phase %d of '%s' is not one of 0..%d" % (bad[0], part, n_phases - 1))
        groups.append((name.strip(), sorted(phases)))
    return groups


def analyse(rows, warps=None, top=6):
    first = next(e for _, _, e, _, _ in rows if e > 0) if any(e > 0 for _, _, e, _, _ in rows) else 0
    nw = warps or first
    if nw <= 0:
        raise Bad("no instruction was executed: nothing to divide by (give --warps)")
    phases, cur = [], None
    for addr, src, e, s, ni in rows:
        if e == 0:
            continue
        if cur is None:
            cur = {"start": addr, "end": addr, "executed": 0, "samples": 0, "not_issued": 0,
                   "ops": collections.Counter(), "barrier": None}
        cur["end"] = addr
        cur["executed"] += e
        cur["samples"] += s
        cur["not_issued"] += ni
        op = opcode(src)
        cur["ops"][op] += e
        if op == "BAR":
            cur["barrier"] = src
            phases.append(cur)
            cur = None
    if cur is not None:
        phases.append(cur)
    ts = sum(p["samples"] for p in phases) or 1
    tn = sum(p["not_issued"] for p in phases) or 1
    total = sum(p["executed"] for p in phases)
    out = []
    for k, p in enumerate(phases):
        out.append({"phase": k, "start": p["start"], "end": p["end"], "barrier": p["barrier"],
                    "instructions_per_warp": p["executed"] / nw,
                    "samples_share": p["samples"] / ts, "not_issued_share": p["not_issued"] / tn,
                    "top": [[o, v / nw] for o, v in p["ops"].most_common(top)]})
    return {"warps": nw, "instructions_per_warp": total / nw,
            "samples": sum(p["samples"] for p in phases), "phases": out}


def table(res, groups):
    lines = ["%d warps, %.1f warp instructions per warp, %d stall samples"
             % (res["warps"], res["instructions_per_warp"], res["samples"]),
             "phase  instr/warp  samples  not-issued  largest opcodes (per warp)"]
    for p in res["phases"]:
        lines.append("%5d  %10.1f  %6.1f%%  %9.1f%%  %s" % (
            p["phase"], p["instructions_per_warp"], 100 * p["samples_share"],
            100 * p["not_issued_share"], " ".join("%s:%.1f" % (o, v) for o, v in p["top"])))
    for g in groups:
        lines.append("%-20s %10.1f  %6.1f%%  phases %s" % (
            g["name"], g["instructions_per_warp"], 100 * g["samples_share"],
            ",".join(str(x) for x in g["phases"])))
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Per-barrier phases of a kernel from ncu's source page CSV "
                    "(ncu -i REPORT --page source --csv --print-source sass).")
    ap.add_argument("csv", help="the CSV file, or - for standard input")
    ap.add_argument("--warps", type=int, help="warps launched (default: the execution count of "
                    "the kernel's first executed instruction)")
    ap.add_argument("--groups", help="named sums of phases: 'name=0,10;other=1-3'")
    ap.add_argument("--top", type=int, default=6, help="opcodes listed per phase (default 6)")
    ap.add_argument("--json", metavar="FILE", help="write the result as JSON (- for stdout)")
    a = ap.parse_args(argv)
    try:
        if a.warps is not None and a.warps <= 0:
            raise Bad("--warps: %d is not a positive count" % a.warps)
        if a.top < 0:
            raise Bad("--top: %d is negative" % a.top)
        res = analyse(read_rows(a.csv), a.warps, a.top)
        groups = []
        if a.groups:
            for name, ph in parse_groups(a.groups, len(res["phases"])):
                sel = [res["phases"][k] for k in ph]
                groups.append({"name": name, "phases": ph,
                               "instructions_per_warp": sum(p["instructions_per_warp"] for p in sel),
                               "samples_share": sum(p["samples_share"] for p in sel)})
        res["groups"] = groups
        text = table(res, groups)
        if a.json:
            js = json.dumps(res, indent=1) + "\n"
            if a.json == "-":
                sys.stdout.write(js)
                sys.stderr.write(text)
            else:
                try:
                    with open(a.json, "w") as f:
                        f.write(js)
                except OSError as e:
                    raise Bad("--json %s: %s" % (a.json, e.strerror))
                sys.stdout.write(text)
        else:
            sys.stdout.write(text)
    except Bad as e:
        sys.stderr.write("ncu_phases: %s\n" % e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
