#!/usr/bin/env python3
"""nll_eval.py refuses a map whose decode_fit or arith it cannot measure, and keeps taking exact
fp32 ones.

nll_eval stores states through the prefill pack, which always takes the exact fit; a map
with decode_fit norefit or rows must be refused with a message naming the map and the field
(else its numbers would be the exact fit's under another name), and so must a map with arith
fp16 (the pack computes in fp32). An explicit "exact" or "fp32" and an absent field must still
pass the self-test; --shrink takes 0 < G < 1 only, --jitter 0..16. Usage: check_nll_eval_fit.py NLL_EVAL SHIM MAP
(MAP: a calibrated stepq map, e.g. config/calibrated/tiny-gdn/stepq@4.json)."""
import json
import os
import subprocess
import sys
import tempfile


def run(nll_eval, shim, path):
    return subprocess.run([sys.executable, nll_eval, "--self-test", "--shim", shim, "--map", "m=" + path],
                          capture_output=True, text=True, timeout=120)


def main():
    nll_eval, shim, base = sys.argv[1:4]
    with open(base) as f:
        m = json.load(f)
    fails = 0
    with tempfile.TemporaryDirectory() as d:
        for fit, ok in (("exact", True), (None, True), ("norefit", False), ("rows", False)):
            mm = dict(m)
            mm.pop("decode_fit", None)
            if fit is not None:
                mm["decode_fit"] = fit
            path = os.path.join(d, "map-%s.json" % (fit or "absent"))
            with open(path, "w") as f:
                json.dump(mm, f)
            r = run(nll_eval, shim, path)
            err = (r.stderr or "").strip().splitlines()
            if ok and r.returncode != 0:
                print("FAIL: decode_fit %s refused: %s" % (fit, err[-1:] or r.returncode))
                fails += 1
            elif not ok and (r.returncode == 0 or not err or "decode_fit \"%s\"" % fit not in err[-1]
                             or path not in err[-1]):
                print("FAIL: decode_fit %s: expected a refusal naming the map and the field, got rc %d: %s"
                      % (fit, r.returncode, err[-1:]))
                fails += 1
            else:
                print("ok   decode_fit %s: %s" % (fit or "(absent)", "taken" if ok else err[-1]))
    # arith likewise: the prefill pack computes in fp32, so a map with arith fp16 is refused naming
    # the map and the field; fp32 written out and an absent field are taken.
    with tempfile.TemporaryDirectory() as d:
        for arith, ok in (("fp32", True), (None, True), ("fp16", False)):
            mm = dict(m)
            mm.pop("decode_fit", None)
            mm.pop("arith", None)
            if arith is not None:
                mm["arith"] = arith
            path = os.path.join(d, "map-arith-%s.json" % (arith or "absent"))
            with open(path, "w") as f:
                json.dump(mm, f)
            r = run(nll_eval, shim, path)
            err = (r.stderr or "").strip().splitlines()
            if ok and r.returncode != 0:
                print("FAIL: arith %s refused: %s" % (arith, err[-1:] or r.returncode))
                fails += 1
            elif not ok and (r.returncode == 0 or not err or "arith \"%s\"" % arith not in err[-1]
                             or path not in err[-1]):
                print("FAIL: arith %s: expected a refusal naming the map and the field, got rc %d: %s"
                      % (arith, r.returncode, err[-1:]))
                fails += 1
            else:
                print("ok   arith %s: %s" % (arith or "(absent)", "taken" if ok else err[-1]))
    # --shrink G (the fp32 state times G after every step) takes 0 < G < 1 only, --jitter N 0..16,
    # each refusal naming the option.
    for opt, g, ok in (("--shrink", "0.999", True), ("--shrink", "1", False), ("--shrink", "0", False),
                       ("--shrink", "-0.5", False), ("--jitter", "4", True), ("--jitter", "17", False),
                       ("--jitter", "-1", False)):
        r = subprocess.run([sys.executable, nll_eval, "--self-test", "--shim", shim, opt, g],
                           capture_output=True, text=True, timeout=120)
        err = (r.stderr or "").strip().splitlines()
        if ok != (r.returncode == 0) or (not ok and (r.returncode != 2 or "%s %s" % (opt, g) not in err[-1])):
            print("FAIL: %s %s: rc %d: %s" % (opt, g, r.returncode, err[-1:]))
            fails += 1
        else:
            print("ok   %s %s: %s" % (opt, g, "taken" if ok else err[-1]))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
