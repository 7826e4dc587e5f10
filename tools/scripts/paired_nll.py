#!/usr/bin/env python3
"""Paired differences of excess NLL between any two methods of one run, from its JSON.

nll_eval.py and served_path.py (--check drift) pair each method with stepq at the same budget
only. Their JSON keeps every method's per-stream excess NLL (the same streams for all), so any
other pair can be formed afterwards without running the model again: for each method M, the mean
and standard error over streams of excess(M) - excess(AGAINST), and how many standard errors
that is. This is what an adoption rule such as tools/CALIBRATION.md's needs (a candidate map
against the committed one, or against every other 4-bit method).

With --vs OTHER.json it pairs across two runs of the same streams instead: each method with the
same method of OTHER (for example the served path's drift run against nll_eval.py's run), the
per-stream difference of excess NLL, its mean and standard error, and the unpaired test the
served-path issue states (the difference of the two means within one standard error of OTHER's).
The two runs must have the same streams (text, offset, prefill, decode, count) where their JSON
says so.

  paired_nll.py RUN.json --against NAME [--methods A,B,...] [--markdown OUT.md] [--json OUT.json]
  paired_nll.py RUN.json --vs OTHER.json [--methods A,B,...] [--markdown OUT.md] [--json OUT.json]

RUN.json: nll_eval.py --json (top-level "results") or served_path.py --json with a drift check
("checks" -> "drift" -> "results").
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nll_eval import ms  # noqa: E402  the mean and standard error both runs' tables use


def rows_of(doc, path):
    """The result rows of an nll_eval or served_path drift JSON document."""
    if isinstance(doc, dict) and isinstance(doc.get("results"), list):
        return doc["results"]
    drift = doc.get("checks", {}).get("drift") if isinstance(doc, dict) else None
    if isinstance(drift, dict) and isinstance(drift.get("results"), list):
        return drift["results"]
    raise SystemExit("paired_nll: %s: neither nll_eval.py's JSON (results) nor served_path.py's with a drift "
                     "check (checks.drift.results)" % path)


def paired(rows, against, methods=None):
    """[(method, mean, se, mean / se)] of excess(method) - excess(against) over the streams."""
    by = {r["method"]: r for r in rows}
    if against not in by:
        raise SystemExit("paired_nll: no method %r in the run (it has %s)" % (against, ", ".join(by)))
    ref = by[against].get("excess_per_stream")
    if not ref:
        raise SystemExit("paired_nll: %r has no excess_per_stream (written by an older nll_eval.py)"
                         % against)
    names = methods or [r["method"] for r in rows if r["method"] not in (against, "fp32")]
    out = []
    for name in names:
        if name not in by:
            raise SystemExit("paired_nll: no method %r in the run (it has %s)" % (name, ", ".join(by)))
        x = by[name].get("excess_per_stream")
        if not x or len(x) != len(ref):
            raise SystemExit("paired_nll: %r has %s per-stream values, %r %d" % (
                name, len(x) if x else "no", against, len(ref)))
        m, se = ms([a - b for a, b in zip(x, ref)])
        out.append((name, m, se, m / se if se > 0 else float("inf") if m else 0.0))
    return out


STREAM_KEYS = ("text", "streams", "prefill", "decode", "offset")


def stream_meta(doc):
    """The stream description of a run (nll_eval: top level; served_path: the drift check's meta)."""
    meta = {}
    if isinstance(doc, dict):
        for src in (doc, doc.get("meta") or {}, (doc.get("checks", {}).get("drift") or {}).get("meta") or {}):
            for k in STREAM_KEYS:
                if k in src and k not in meta:
                    meta[k] = os.path.basename(src[k]) if k == "text" else src[k]
    return meta


def across(rows, other, methods=None):
    """[(method, mean_a, se_a, mean_b, se_b, paired mean, paired se, paired / se)] for the methods of
    both runs (or the named ones): the per-stream excess of RUN minus that of OTHER."""
    by, ob = {r["method"]: r for r in rows}, {r["method"]: r for r in other}
    names = methods or [r["method"] for r in rows if r["method"] != "fp32" and r["method"] in ob]
    if not names:
        raise SystemExit("paired_nll: the two runs have no method in common besides fp32")
    out = []
    for name in names:
        for run, b in (("RUN", by), ("OTHER", ob)):
            if name not in b:
                raise SystemExit("paired_nll: no method %r in %s (it has %s)" % (name, run, ", ".join(b)))
        x, y = by[name].get("excess_per_stream"), ob[name].get("excess_per_stream")
        if not x or not y:
            raise SystemExit("paired_nll: %r has no excess_per_stream in %s (written by an older tool)"
                             % (name, "RUN" if not x else "OTHER"))
        if len(x) != len(y):
            raise SystemExit("paired_nll: %r has %d per-stream values in RUN, %d in OTHER" % (name, len(x), len(y)))
        ma, sa = ms(x)
        mb, sb = ms(y)
        m, se = ms([u - v for u, v in zip(x, y)])
        out.append((name, ma, sa, mb, sb, m, se, m / se if se > 0 else float("inf") if m else 0.0))
    return out


def load(path, what):
    """The JSON document at path; SystemExit naming `what` when it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit("paired_nll: %s%s: %s" % (what, path, e))


def main_vs(a, doc, rows):
    odoc = load(a.vs, "--vs ")
    orows = rows_of(odoc, a.vs)
    ma, mb = stream_meta(doc), stream_meta(odoc)
    bad = [k for k in STREAM_KEYS if k in ma and k in mb and ma[k] != mb[k]]
    if bad:
        raise SystemExit("paired_nll: --vs %s: not the same streams (%s)" % (
            a.vs, ", ".join("%s %r vs %r" % (k, ma[k], mb[k]) for k in bad)))
    res = across(rows, orows, [m.strip() for m in a.methods.split(",")] if a.methods else None)
    lines = ["| method | RUN excess | OTHER excess | difference of means | within 1 s.e. of OTHER | "
             "RUN minus OTHER (paired) | in paired s.e. |", "|---|---:|---:|---:|---|---:|---:|"]
    for n, x, sx, y, sy, m, se, z in res:
        lines.append("| %s | %+.5f +- %.5f | %+.5f +- %.5f | %+.5f | %s | %+.5f +- %.5f | %+.1f |" % (
            n, x, sx, y, sy, x - y, "yes" if abs(x - y) <= sy else "NO", m, se, z))
    lines += ["", "RUN %s, OTHER %s: %s; excess NLL in nats/byte, mean +- s.e. over streams; the paired column "
              "is the mean +- s.e. of the per-stream difference." % (
                  a.run, a.vs, ", ".join("%s %s" % (k, ma.get(k, mb.get(k))) for k in STREAM_KEYS
                                         if k in ma or k in mb) or "streams as each JSON has them")]
    return emit(a, lines, {"run": a.run, "vs": a.vs, "pairs": [
        {"method": n, "run_excess": x, "run_se": sx, "other_excess": y, "other_se": sy,
         "difference": x - y, "within_one_se": abs(x - y) <= sy,
         "paired_mean": m, "paired_se": se, "in_se": z} for n, x, sx, y, sy, m, se, z in res]})


def emit(a, lines, doc):
    """Prints the table, and writes it to --markdown and doc to --json where given."""
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="nll_eval.py or served_path.py JSON")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--against", help="the method every other is paired with")
    g.add_argument("--vs", metavar="OTHER", help="pair each method with the same method of this run of the "
                   "same streams (nll_eval.py or served_path.py JSON)")
    p.add_argument("--methods", help="comma list (default: every method but fp32 and --against)")
    p.add_argument("--markdown", help="write the table here too")
    p.add_argument("--json", help="write the pairs here as JSON")
    a = p.parse_args(argv)
    doc = load(a.run, "")
    rows = rows_of(doc, a.run)
    if a.vs:
        return main_vs(a, doc, rows)
    res = paired(rows, a.against, [m.strip() for m in a.methods.split(",")] if a.methods else None)
    lines = ["| method | minus %s (paired) | in s.e. |" % a.against, "|---|---:|---:|"]
    lines += ["| %s | %+.5f +- %.5f | %+.1f |" % r for r in res]
    lines += ["", "%d streams of %s; excess NLL in nats/byte, mean +- s.e. over streams of the per-stream "
              "difference." % (len(next(r for r in rows if r["method"] == a.against)["excess_per_stream"]), a.run)]
    return emit(a, lines, {"run": a.run, "against": a.against,
                           "pairs": [{"method": n, "mean": m, "se": s, "in_se": z} for n, m, s, z in res]})


if __name__ == "__main__":
    sys.exit(main())
