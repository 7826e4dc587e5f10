#!/usr/bin/env python3
"""Draws a line chart from a JSON spec read on stdin (used by `stepq capacity --plot`).

Spec:
  {"output": "mem.png",            # .png, .svg or .pdf (from the extension)
   "title": "...", "xlabel": "...", "ylabel": "...",
   "x": [1, 8, 64, 512], "logx": true, "logy": false,
   "series": [{"label": "FP32 state pool", "y": [...], "style": "-o"}, ...],
                                   # a series may give its own "x"; "logx_base" (default 2);
                                   # "legend_outside": true puts the legend right of the axes
   "hlines": [{"label": "weights (BF16)", "y": 50.1}, ...]}
Exits non-zero with a message on stderr when the spec is malformed or the
file cannot be written.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write files only
import matplotlib.pyplot as plt  # noqa: E402


def main():
    spec = json.load(sys.stdin)
    x = spec["x"]
    outside = spec.get("legend_outside", False)
    fig, ax = plt.subplots(figsize=(9.5 if outside else 7.0, 4.5), dpi=150)
    markers = "osD^v<>p*hX"
    for i, s in enumerate(spec.get("series", [])):
        sx = s.get("x", x)  # a series may carry its own x values (stepq eval)
        if len(s["y"]) != len(sx):
            raise ValueError("series %r has %d points for %d x values"
                             % (s.get("label"), len(s["y"]), len(sx)))
        style = s.get("style", "-o")
        if outside and style == "o":  # many scatter series: vary the marker too
            style = markers[i % len(markers)]
        ax.plot(sx, s["y"], style, label=s.get("label"), markersize=4 if outside else 6)
    for i, h in enumerate(spec.get("hlines", [])):
        ax.axhline(h["y"], linestyle="--", color="C%d" % (7 + i % 3), label=h.get("label"))
    if spec.get("logx"):
        ax.set_xscale("log", base=spec.get("logx_base", 2))
        if x:
            ax.set_xticks(x)
            ax.set_xticklabels([str(v) for v in x])
    if spec.get("logy"):
        ax.set_yscale("log")
    ax.set_title(spec.get("title", ""))
    ax.set_xlabel(spec.get("xlabel", ""))
    ax.set_ylabel(spec.get("ylabel", ""))
    ax.grid(True, which="both", alpha=0.3)
    if outside:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(spec["output"])
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyError, ValueError, TypeError, OSError) as e:
        print("plot.py: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        sys.exit(1)
