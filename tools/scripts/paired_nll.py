#!/usr/bin/env python3
"""Paired differences of excess NLL between any two methods of one run, from its JSON.

nll_eval.py and served_path.py (--check drift) pair each method with stepq at the same budget
only. Their JSON keeps every method's per-stream excess NLL (the same streams for all), so any
other pair can be formed afterwards without running the model again: for each method M, the mean
and standard error over streams of excess(M) - excess(AGAINST), and how many standard errors
that is. This is what an adoption rule such as tools/CALIBRATION.md's needs (a candidate map
against the committed one, or against every other 4-bit method).

  paired_nll.py RUN.json --against NAME [--methods A,B,...] [--markdown OUT.md] [--json OUT.json]

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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="nll_eval.py or served_path.py JSON")
    p.add_argument("--against", required=True, help="the method every other is paired with")
    p.add_argument("--methods", help="comma list (default: every method but fp32 and --against)")
    p.add_argument("--markdown", help="write the table here too")
    p.add_argument("--json", help="write the pairs here as JSON")
    a = p.parse_args(argv)
    try:
        with open(a.run) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit("paired_nll: %s: %s" % (a.run, e))
    rows = rows_of(doc, a.run)
    res = paired(rows, a.against, [m.strip() for m in a.methods.split(",")] if a.methods else None)
    lines = ["| method | minus %s (paired) | in s.e. |" % a.against, "|---|---:|---:|"]
    lines += ["| %s | %+.5f +- %.5f | %+.1f |" % r for r in res]
    lines += ["", "%d streams of %s; excess NLL in nats/byte, mean +- s.e. over streams of the per-stream "
              "difference." % (len(next(r for r in rows if r["method"] == a.against)["excess_per_stream"]), a.run)]
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"run": a.run, "against": a.against,
                       "pairs": [{"method": n, "mean": m, "se": s, "in_se": z} for n, m, s, z in res]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
