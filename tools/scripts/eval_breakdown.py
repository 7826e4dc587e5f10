#!/usr/bin/env python3
"""Where a method's error comes from: `stepq eval`'s JSON broken down per layer and per head.

Reads the JSON of `stepq eval --json FILE` (per map: every head's relative
readout error and accumulated state error; per head: layer, head, half-life)
and prints markdown:
  - per layer, each map's mean relative readout error over the layer's heads;
  - for a pair A/B (--pair A,B, repeatable), the heads where A loses most to B
    (ratio of their readout errors), with the half-life, and how many heads A
    loses at all, by half-life third.

  eval_breakdown.py EVAL.json [--maps m1,m2,...] [--pair A,B]... [--top N] [--markdown OUT.md]
"""
import argparse
import json
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("eval_json")
    p.add_argument("--maps", help="comma list of map names to show (default: all but the internal one)")
    p.add_argument("--pair", action="append", default=[], help="A,B: heads where A's error most exceeds B's")
    p.add_argument("--top", type=int, default=12, help="heads listed per pair (default 12)")
    p.add_argument("--markdown", help="also write the markdown here")
    a = p.parse_args(argv)
    try:
        with open(a.eval_json) as f:
            d = json.load(f)
        heads, methods = d["heads"], {m["name"]: m for m in d["methods"]}
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit("eval_breakdown: %s: not the JSON of stepq eval (%s)" % (a.eval_json, e))
    names = a.maps.split(",") if a.maps else [n for n in methods if "internal" not in n]
    for n in names + [x for pr in a.pair for x in pr.split(",")]:
        if n not in methods:
            raise SystemExit("eval_breakdown: no map named %s in %s (maps: %s)"
                             % (n, a.eval_json, ", ".join(methods)))
    for m in methods.values():
        if len(m.get("head_readout_rel", [])) != len(heads):
            raise SystemExit("eval_breakdown: %s: %s has %d head errors for %d heads"
                             % (a.eval_json, m["name"], len(m.get("head_readout_rel", [])), len(heads)))
    layers = sorted({h["layer"] for h in heads})
    out = ["### Relative readout error per layer (mean over its heads)", "",
           "| layer | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for L in layers:
        idx = [i for i, h in enumerate(heads) if h["layer"] == L]
        out.append("| %d | %s |" % (L, " | ".join(
            "%.3e" % (sum(methods[n]["head_readout_rel"][i] for i in idx) / len(idx)) for n in names)))
    out.append("")
    by_hl = sorted(range(len(heads)), key=lambda i: heads[i]["half_life"])
    third = {i: min(2, 3 * r // len(heads)) for r, i in enumerate(by_hl)}
    for pr in a.pair:
        A, B = pr.split(",")
        ea, eb = methods[A]["head_readout_rel"], methods[B]["head_readout_rel"]
        ratio = [(ea[i] / eb[i]) if eb[i] > 0 else float("inf") for i in range(len(heads))]
        lose = [sum(1 for i in range(len(heads)) if third[i] == t and ratio[i] > 1) for t in range(3)]
        per = [sum(1 for i in range(len(heads)) if third[i] == t) for t in range(3)]
        out.append("### %s against %s" % (A, B))
        out.append("")
        out.append("%s has the larger readout error in %d of %d heads (shortest / middle / longest "
                   "half-life third: %d of %d, %d of %d, %d of %d)."
                   % (A, sum(lose), len(heads), lose[0], per[0], lose[1], per[1], lose[2], per[2]))
        out.append("")
        out.append("| layer | head | half-life | %s | %s | ratio |" % (A, B))
        out.append("|---:|---:|---:|---:|---:|---:|")
        for i in sorted(range(len(heads)), key=lambda i: -ratio[i])[:a.top]:
            h = heads[i]
            out.append("| %d | %d | %.1f | %.3e | %.3e | %.2f |" % (h["layer"], h["head"], h["half_life"],
                                                                  ea[i], eb[i], ratio[i]))
        out.append("")
    text = "\n".join(out)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
