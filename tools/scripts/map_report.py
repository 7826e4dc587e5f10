#!/usr/bin/env python3
"""Where a calibrated map spends its bits: the per-unit width histogram and the pivot units.

Reads the per-unit reports of `stepq calibrate --report FILE` (one JSON per
map: every unit's layer, head, key row (KDA; -1 for GDN heads), half-life on
the calibration split and chosen width, 16 = fp16 pivot), or a calibrated map
itself (its units' widths and the log retention its calibration stored,
half-life = ln 2 / -log retention, as the report's), and prints markdown:
  - per map, the histogram of widths, overall and per layer;
  - the widths by half-life band (how the lifetime-aware allocation follows the gates);
  - the pivot units, sorted by half-life, with layer, head and row.

  map_report.py NAME=REPORT.json|NAME=MAP.json ... [--markdown OUT.md] [--pivots N]
"""
import argparse
import json
import sys

BANDS = ((0, 2), (2, 10), (10, 100), (100, 1000), (1000, float("inf")))


def band_name(lo, hi):
    return "<%g" % hi if lo == 0 else (">=%g" % lo if hi == float("inf") else "%g-%g" % (lo, hi))


def hist_line(units):
    h = {}
    for u in units:
        h[u["bits"]] = h.get(u["bits"], 0) + 1
    return ", ".join("%s%d x%d" % ("fp16 " if b == 16 else "", b, n) for b, n in sorted(h.items()))


def report(name, rep, max_pivots):
    units = rep["units"]
    kda = any(u["row"] >= 0 for u in units)
    unit = "key row" if kda else "head"
    out = ["### %s (%s@%g, %d %ss)" % (name, rep["method"], rep["budget"], len(units), unit), ""]
    out.append("widths: %s" % hist_line(units))
    out.append("")
    out.append("| layer | widths |")
    out.append("|---:|---|")
    for L in sorted({u["layer"] for u in units}):
        out.append("| %d | %s |" % (L, hist_line([u for u in units if u["layer"] == L])))
    out.append("")
    out.append("| half-life (tokens, calibration split) | %ss | mean bits (pivots as 16) | pivots | widths |" % unit)
    out.append("|---|---:|---:|---:|---|")
    for lo, hi in BANDS:
        us = [u for u in units if lo <= u["half_life"] < hi]
        if not us:
            continue
        out.append("| %s | %d | %.2f | %d | %s |" % (band_name(lo, hi), len(us),
                                                   sum(u["bits"] for u in us) / len(us),
                                                   sum(u["bits"] == 16 for u in us), hist_line(us)))
    piv = sorted((u for u in units if u["bits"] == 16), key=lambda u: -u["half_life"])
    out.append("")
    if piv:
        hl = sorted(u["half_life"] for u in units)
        rank = {id(u): sum(h < u["half_life"] for h in hl) for u in piv}
        out.append("%d pivot %ss (fp16), by half-life%s:" % (len(piv), unit,
                                                            "" if len(piv) <= max_pivots else
                                                            ", the %d longest shown" % max_pivots))
        out.append("")
        out.append("| layer | head | %s | half-life | percentile of half-life |" % ("row" if kda else "-"))
        out.append("|---:|---:|---:|---:|---:|")
        for u in piv[:max_pivots]:
            out.append("| %d | %d | %s | %.1f | %.1f |" % (u["layer"], u["head"], u["row"] if kda else "-",
                                                          u["half_life"], 100.0 * rank[id(u)] / len(units)))
    else:
        out.append("no pivot units")
    out.append("")
    return out


def half_life(log_retention):
    """Tokens for a unit's contents to halve (tools/calib: ln 2 / -l; 1e30 without decay)."""
    return 0.69314718055994531 / -log_retention if log_retention < 0 else 1e30


def report_of_map(m, path):
    """A calibrate report's fields from a calibrated map (config/SCHEMA.md): method, budget and one
    unit per head (GDN) or key row (KDA) with its layer, head, row, width and half-life."""
    kda = m["model"]["arch"] == "kda"
    if not m.get("layers"):
        raise SystemExit("map_report: %s: a %s map has no per-unit widths" % (path, m.get("method")))
    units = []
    for L in m["layers"]:
        for hi, h in enumerate(L["heads"]):
            lr = h.get("stats", {}).get("log_retention")
            if lr is None:
                raise SystemExit("map_report: %s: layer %d head %d has no calibration stats (log_retention): "
                                 "not a calibrated map" % (path, L["layer"], hi))
            if kda:
                for r, (b, l) in enumerate(zip(h["row_bits"], lr)):
                    units.append({"layer": L["layer"], "head": hi, "row": r, "bits": b, "half_life": half_life(l)})
            else:
                units.append({"layer": L["layer"], "head": hi, "row": -1, "bits": h["bits"],
                              "half_life": half_life(lr if not isinstance(lr, list) else lr[0])})
    return {"method": m["method"], "budget": m["budget_bits"], "units": units}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reports", nargs="+", help="NAME=REPORT.json (from stepq calibrate --report) or "
                   "NAME=MAP.json (a calibrated map)")
    p.add_argument("--markdown", help="write the markdown here as well as to stdout")
    p.add_argument("--pivots", type=int, default=40, help="pivot units listed per map (default 40)")
    a = p.parse_args(argv)
    lines = []
    for spec in a.reports:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = spec, spec
        try:
            with open(path) as f:
                rep = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit("map_report: %s: %s" % (path, e))
        if rep.get("format") == "stepq-precision-map":
            rep = report_of_map(rep, path)
        if "units" not in rep:
            raise SystemExit("map_report: %s: neither a calibrate report (no units) nor a precision map" % path)
        lines += report(name, rep, a.pivots)
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
