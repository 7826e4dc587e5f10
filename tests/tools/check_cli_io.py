#!/usr/bin/env python3
"""The stepq commands' machine output, progress, output files and number options:
  - --json prints one valid JSON document on stdout (messages on stderr) for every
    command that reports; -o FILE puts the same bytes into FILE;
  - a write error names the output path, not a temporary file, and leaves nothing;
  - SIGINT during a long synth leaves no partial file;
  - progress lines appear on stderr when forced (STEPQ_PROGRESS=lines), never on stdout;
  - simulate with a MAP and no --requests runs a short default, an explicit count is kept;
  - eval's table fits 100 columns with a legend, --classes adds the per-class columns;
  - every number option refuses non-finite, out-of-range and trailing-garbage values
    with exit status 2 and one line naming the option;
  - --threads above the useful count is capped and said; candidate widths that leave the
    budget unused warn; bench kernels says why --batch 3 is refused; a failing map of
    several is named; a path is said once.
Usage: check_cli_io.py STEPQ_EXE SOURCE_ROOT"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

EXE, ROOT = sys.argv[1], sys.argv[2]
MAP27 = os.path.join(ROOT, "config", "examples", "qwen3.8-27b.stepq-6-layout.json")
TINY = os.path.join(ROOT, "config", "calibrated", "tiny-gdn", "stepq@6.json")
QUIET = dict(os.environ, STEPQ_PROGRESS="off")
bad = 0


def run(args, env=QUIET, **kw):
    return subprocess.run([EXE] + args, capture_output=True, text=True, env=env, **kw)


def check(ok, what, detail=""):
    global bad
    print("%s %s%s" % ("ok  " if ok else "FAIL", what, "" if ok else ": " + detail))
    bad += not ok


def parses(text):
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main():
    d = tempfile.mkdtemp(prefix="stepq-cli-")
    tr = os.path.join(d, "tr")
    p = run(["synth", "--out", tr, "--layers", "2", "--streams", "2", "--T", "128", "--json"])
    check(p.returncode == 0 and json.loads(p.stdout)["files"] == [tr + "-000.safetensors"],
          "synth --json lists the files", p.stdout + p.stderr)
    trace = tr + "-000.safetensors"
    m4 = os.path.join(d, "stepq@4.json")
    p = run(["calibrate", "--trace", trace, "--method", "stepq", "--budget", "4", "--out", m4,
             "--pivot-fraction", "0.07", "--json"])
    check(p.returncode == 0 and parses(p.stdout) and json.loads(p.stdout)["units"] == 8,
          "calibrate --json: a summary on stdout", p.stdout + p.stderr)

    # --json on stdout, valid, and -o FILE gets the same bytes.
    reports = [
        ["inspect", MAP27],
        ["capacity", MAP27, "--batch", "1,8"],
        ["simulate", "--requests", "50"],
        ["eval", "--map", m4, "--trace", trace, "--threads", "1"],
        ["bench", "reference", "--dk", "16", "--dv", "16", "--heads", "1", "--batch", "1",
         "--min-ms", "1"],
        ["bench", "pool", "--backend", "host", "--page-bytes", "4096", "--slots", "1",
         "--min-ms", "1"],
        ["bench", "decode", MAP27, "--backend", "host", "--batch", "1", "--tokens", "2",
         "--layers", "1"],
    ]
    for args in reports:
        p = run(args + ["--json"])
        check(p.returncode == 0 and parses(p.stdout), " ".join(args[:2]) + " --json parses",
              p.stdout[:300] + p.stderr)
        out = os.path.join(d, "o.txt")
        q = run(args + ["-o", out])
        ok = q.returncode == 0 and q.stdout == "" and os.path.exists(out)
        if ok and args[0] in ("inspect", "capacity"):  # deterministic: same bytes as stdout
            ok = open(out).read() == run(args).stdout
        check(ok and not glob.glob(out + ".tmp.*"), " ".join(args[:2]) + " -o FILE", q.stderr)
    p = run(["eval", "--map", m4, "--trace", trace, "--json", "-o", os.path.join(d, "e.json")])
    check(p.returncode == 0 and parses(open(os.path.join(d, "e.json")).read()),
          "eval --json -o FILE: the JSON in FILE", p.stderr)
    # The older form stays: --json FILE writes the JSON and keeps the table on stdout.
    p = run(["eval", "--map", m4, "--trace", trace, "--json", os.path.join(d, "e2.json")])
    check(p.returncode == 0 and p.stdout.startswith("stepq eval:") and
          parses(open(os.path.join(d, "e2.json")).read()), "eval --json FILE: table and file")

    # A write error names the output path, never the temporary file, and leaves nothing.
    nodir = os.path.join(d, "no-such-dir", "x.json")
    for args in (["mkmap", "--shape", "tiny-gdn", "--method", "stepq", "--bits", "6", "--out", nodir],
                 ["calibrate", "--trace", trace, "--method", "stepq", "--budget", "4", "--out", nodir],
                 ["synth", "--out", nodir],
                 ["inspect", MAP27, "-o", nodir],
                 ["eval", "--map", m4, "--trace", trace, "-o", nodir]):
        p = run(args)
        lines = p.stderr.strip().splitlines()
        check(p.returncode == 1 and len(lines) == 1 and nodir.split(".json")[0] in lines[0] and
              ".tmp." not in p.stderr, args[0] + ": a write error names the path", p.stderr)
    # A target that is not a regular file is written in place, never renamed over.
    if os.path.exists("/dev/full"):
        p = run(["inspect", MAP27, "-o", "/dev/full"])
        check(p.returncode == 1 and "/dev/full" in p.stderr and
              not os.path.isfile("/dev/full"), "inspect -o /dev/full: the write error", p.stderr)
    p = run(["inspect", MAP27, "-o", "/dev/null"])
    check(p.returncode == 0 and not os.path.isfile("/dev/null"), "inspect -o /dev/null", p.stderr)

    # SIGINT in the middle of a long synth: no partial file, no temporary file.
    big = os.path.join(d, "big")
    c = subprocess.Popen([EXE, "synth", "--out", big, "--T", "1000000", "--K", "64", "--V", "64"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=QUIET,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    while not glob.glob(big + "*") and time.time() - t0 < 20:
        time.sleep(0.05)
    started = bool(glob.glob(big + "*"))
    time.sleep(0.3)
    c.send_signal(signal.SIGINT)
    c.communicate()
    check(started and c.returncode == -signal.SIGINT and not glob.glob(big + "*"),
          "synth killed by SIGINT leaves no file", "rc %s, %s" % (c.returncode, glob.glob(big + "*")))

    # Progress: on stderr when forced, never on stdout (stdout as without it).
    env = dict(os.environ, STEPQ_PROGRESS="lines", STEPQ_PROGRESS_INTERVAL="0")
    p = run(["simulate", "--requests", "300", "--json"], env=env)
    q = run(["simulate", "--requests", "300", "--json"])
    strip = lambda t: {k: v for k, v in json.loads(t).items() if k != "seconds"}
    check(p.returncode == 0 and "requests (" in p.stderr and "done in" in p.stderr and
          strip(p.stdout) == strip(q.stdout) and "requests (" not in q.stderr,
          "simulate: progress lines on stderr only", p.stderr[-200:])
    p = run(["eval", "--map", m4, "--trace", trace], env=env)
    check(p.returncode == 0 and "heads (" in p.stderr and "heads (" not in p.stdout,
          "eval: progress per head on stderr", p.stderr)
    p = run(["synth", "--out", os.path.join(d, "pg")], env=env)
    check(p.returncode == 0 and "kB" in p.stderr and p.stdout.strip().endswith(".safetensors"),
          "synth: progress in bytes on stderr", p.stderr)

    # simulate with a MAP: a short default; an explicit --requests is what runs.
    p = run(["simulate", MAP27, "--max-running", "1", "--json"], timeout=120)  # 6 pages
    check(p.returncode == 0 and json.loads(p.stdout)["requests"] == 200,
          "simulate MAP: 200 requests by default", p.stdout + p.stderr)
    p = run(["simulate", "--json"])
    check(p.returncode == 0 and json.loads(p.stdout)["requests"] == 100000,
          "simulate without MAP: 100000 requests by default", p.stderr)

    # eval's table: 100 columns, a legend, per-class columns behind --classes.
    p = run(["eval", "--map", m4, "--trace", trace])
    width = max(len(l) for l in p.stdout.splitlines())
    check(p.returncode == 0 and width <= 100 and "global:" in p.stdout and
          "state short" not in p.stdout, "eval table fits 100 columns (%d)" % width, p.stdout)
    p = run(["eval", "--map", m4, "--trace", trace, "--classes"])
    check(p.returncode == 0 and "state long" in p.stdout.splitlines()[1],
          "eval --classes: the per-class columns", p.stdout)

    # Threads, candidates, bench kernels --batch, which map failed, the path once.
    p = run(["eval", "--map", m4, "--trace", trace, "--threads", "64"])
    check(p.returncode == 0 and "using 8 threads" in p.stderr, "eval --threads 64 capped", p.stderr)
    p = run(["calibrate", "--trace", trace, "--method", "stepq", "--budget", "4", "--threads", "64",
             "--out", os.path.join(d, "t.json")])
    check(p.returncode == 0 and "using 8 threads" in p.stderr and "on 8 threads" in p.stderr,
          "calibrate --threads 64 capped and said", p.stderr)
    p = run(["calibrate", "--trace", trace, "--method", "stepq", "--budget", "6", "--candidates",
             "3,4", "--out", os.path.join(d, "c.json")])
    check(p.returncode == 0 and "warning" in p.stderr and "--candidates 3,4" in p.stderr,
          "calibrate: candidates below the budget warn", p.stderr)
    p = run(["bench", "kernels", "--batch", "3"])
    check(p.returncode == 2 and "--batch 3" in p.stderr and "512" in p.stderr,
          "bench kernels --batch 3 says why", p.stderr)
    badmap = os.path.join(d, "bad.json")
    open(badmap, "w").write("{")
    p = run(["eval", "--map", m4, badmap, "--trace", trace])
    check(p.returncode == 1 and badmap in p.stderr, "eval names the map that failed", p.stderr)
    for args in (["inspect", badmap], ["inspect", os.path.join(d, "none.json")],
                 ["simulate", os.path.join(d, "none.json")], ["capacity", os.path.join(d, "none.json")]):
        p = run(args)
        check(p.returncode == 1 and p.stderr.count(args[1]) == 1,
              " ".join(args[:1]) + ": the path once", p.stderr)

    # Number options: nan, inf, out of range, trailing garbage, empty; exit 2, one line naming it.
    numbers = [
        (["simulate"], ["--requests", "--seed", "--max-running", "--track-interval", "--budget"],
         ["nan", "1x", "-1", "", "1e3"]),
        (["simulate"], ["--abort-rate"], ["nan", "inf", "2", "0.5x", ""]),
        (["synth", "--out", os.path.join(d, "n")],
         ["--layers", "--H", "--HV", "--K", "--V", "--streams", "--T", "--streams-per-file",
          "--row-outliers", "--col-outliers", "--seed"], ["nan", "-1", "2x", "", "99999999999"]),
        (["synth", "--out", os.path.join(d, "n")], ["--halflife-min", "--halflife-max"],
         ["nan", "inf", "0", "-1", "1x"]),
        (["calibrate", "--trace", trace, "--method", "stepq", "--out", os.path.join(d, "n.json"),
          "--budget", "4"], ["--budget", "--pivot-fraction", "--w-floor"], ["nan", "inf", "-1", "1x"]),
        (["calibrate", "--trace", trace, "--method", "stepq", "--out", os.path.join(d, "n.json"),
          "--budget", "4"], ["--horizon", "--samples", "--prop-steps", "--threads", "--conv-kernel"],
         ["nan", "0", "1x", ""]),
        (["eval", "--map", m4, "--trace", trace], ["--threads", "--bucket", "--inject-step"],
         ["nan", "-1", "1x", ""]),
        (["mkmap", "--shape", "tiny-gdn", "--method", "stepq"], ["--bits", "--pivots"],
         ["nan", "-1", "1x", ""]),
        (["bench", "reference"], ["--dk", "--dv", "--heads", "--batch", "--min-ms"],
         ["nan", "0", "1x", ""]),
        (["bench", "pool"], ["--page-bytes"], ["nan", "-5", "1x", "", "100"]),
        (["bench", "pool"], ["--min-ms"], ["nan", "inf", "0", "-5", "1x"]),
        (["bench", "pool"], ["--slots"], ["nan", "0", "1,x", "", "1,,2", ",".join(["1"] * 17)]),
        (["bench", "kernels"], ["--batch"], ["nan", "0", "8x", ""]),
        (["bench", "decode", MAP27], ["--tp", "--rank", "--tokens", "--prompt", "--runs",
                                      "--warmup", "--warmup-tokens", "--budget-gib", "--batch",
                                      "--layers"],
         ["nan", "-1", "1x", ""]),
    ]
    for base, opts, values in numbers:
        for opt in opts:
            fails = []
            for v in values:
                p = run(base + [opt, v])
                lines = p.stderr.strip().splitlines()
                if not (p.returncode == 2 and len(lines) == 1 and opt in lines[0]):
                    fails.append("%r: rc %d %r" % (v, p.returncode, p.stderr.strip()[:200]))
            check(not fails, "%s %s refuses bad numbers" % (" ".join(base[:2]), opt),
                  "; ".join(fails))
    shutil.rmtree(d)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
