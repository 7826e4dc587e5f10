#!/usr/bin/env python3
"""stepq bench decode --tp N --procs (one process per rank) on the host backend:
  - --json: one document with both ranks' own results (rank 0 and rank 1, distinct pids),
    each rank's state bytes per request `stepq inspect --tp 2` reports for that rank, and
    per batch and state a decode time that is the largest of the ranks' (tokens/s from it);
  - the table's ms/step is the largest of the per-rank columns;
  - a rank that fails (STEPQ_BENCH_RANK_FAIL=R: status 1, R:kill: SIGKILL, R:hang with
    --timeout-s) ends the run at once with a non-zero status and one line naming the rank
    (the ranks' own lines are prefixed "[rank R]"), and no rank process is left running,
    nor after the parent is killed by SIGKILL;
  - bad input (a --tp the heads do not split into, --rank with --procs) is refused in one
    line before any rank starts;
  - CUDA (skipped without a device): --tp 1 --procs runs one rank; --tp 2 --procs either
    runs each NCCL rank on its own device or, on a host with fewer devices than ranks,
    is refused in one line naming both numbers before any rank starts (NCCL holds one
    rank per device).
Usage: check_bench_decode_procs.py STEPQ_EXE SOURCE_ROOT"""
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_checks import check, failed  # noqa: E402
import time
import uuid

EXE, ROOT = sys.argv[1], sys.argv[2]
MAP = os.path.join(ROOT, "config", "examples", "qwen3.8-27b.stepq-6-layout.json")
TAG = "STEPQ_PROCS_TEST_TAG"
SMALL = ["--backend", "host", "--batch", "1,3", "--tokens", "3", "--layers", "1"]
CUDA = ["--backend", "cuda", "--batch", "1", "--tokens", "2", "--layers", "1", "--runs", "1",
        "--warmup", "0"]
# Long enough that rank 0 is still running when rank 1 fails (minutes on the host).
LONG = ["--backend", "host", "--batch", "8", "--tokens", "5000", "--layers", "4"]



def run(args, tag, **env):
    e = dict(os.environ, STEPQ_PROGRESS="off", **env)
    e[TAG] = tag
    e.pop("STEPQ_BENCH_RANK_FAIL", None)
    e.update(env)
    t0 = time.monotonic()
    p = subprocess.run([EXE, "bench", "decode", MAP, "--tp", "2"] + args, capture_output=True,
                       text=True, env=e, timeout=300)
    return p, time.monotonic() - t0


def left_running(tag):
    """The processes whose environment holds the run's tag: its ranks, if any outlived it."""
    want = ("%s=%s" % (TAG, tag)).encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/environ" % pid, "rb") as f:
                if want in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def own_lines(stderr):
    return [l for l in stderr.splitlines() if not l.startswith("[rank ")]


def main():
    ins = json.loads(subprocess.run([EXE, "inspect", MAP, "--tp", "2", "--json"],
                                    capture_output=True, text=True, check=True).stdout)
    want_state = [r["state_bytes"] for r in ins["tp"]["ranks"]]

    tag = uuid.uuid4().hex
    p, _ = run(SMALL + ["--procs", "--json"], tag)
    try:
        d = json.loads(p.stdout)
        ranks = d["ranks"]
        ok = (p.returncode == 0 and d["procs"] and d["tp"] == 2 and
              [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2 and
              all(r["backend"] == "host" and r["tp"] == 2 for r in ranks))
    except (ValueError, KeyError, TypeError) as e:
        print(e)
        d, ok = None, False
    check(ok, "--procs --json: both ranks' own results", p.stdout[:400] + p.stderr)
    if not d:
        return 1
    check(not left_running(tag), "--procs: no rank process outlives the run")
    for r, rank in enumerate(ranks):
        s = {x["label"]: x for x in rank["states"]}["stepq@6"]
        check(s["state_bytes_per_request"] == want_state[r],
              "--procs rank %d: stepq@6 state bytes = stepq inspect --tp 2's" % r,
              "%s vs %s" % (s["state_bytes_per_request"], want_state[r]))
    tokens = ranks[0]["generated_tokens"]
    for i, b in enumerate(d["batches"]):
        for v, row in enumerate(b["rows"]):
            each = [rank["batches"][i]["rows"][v]["decode_s"] for rank in ranks]
            ok = (row["ran"] and row["decode_s_per_rank"] == each and
                  row["decode_s"] == max(each) and row["slowest_rank"] == each.index(max(each)) and
                  abs(row["tokens_per_s"] - b["batch"] * tokens / max(each)) <=
                  1e-9 * row["tokens_per_s"])
            check(ok, "--procs B=%d %s: the decode time is the slowest rank's" %
                  (b["batch"], row["label"]), str(row))

    # The table: ms/step = the largest of the ranks' columns.
    p, _ = run(SMALL + ["--procs"], uuid.uuid4().hex)
    rows = [l.split() for l in p.stdout.splitlines()
            if l.split() and l.split()[0] in ("1", "3") and len(l.split()) == 8]
    ok = p.returncode == 0 and "one process per rank" in p.stdout and len(rows) == 6
    for f in rows:
        ok = ok and float(f[3]) == max(float(f[6]), float(f[7])) and f[5] in ("0", "1")
    check(ok, "--procs table: ms/step is the slowest rank's", p.stdout + p.stderr)

    # A rank that fails stops the run at once; one line names it; nothing is left running.
    for hook, args, want in (
            ("1", LONG, "stepq bench decode: rank 1 exited with status 1: rank 1 fails"),
            ("1:kill", LONG, "stepq bench decode: rank 1 died (signal 9)"),
            ("0:hang", SMALL + ["--timeout-s", "2"], "stepq bench decode: --timeout-s 2 passed")):
        tag = uuid.uuid4().hex
        p, took = run(args + ["--procs"], tag, STEPQ_BENCH_RANK_FAIL=hook)
        lines = own_lines(p.stderr)
        check(p.returncode != 0 and len(lines) == 1 and lines[0].startswith(want) and
              p.stdout == "" and took < 30,
              "--procs STEPQ_BENCH_RANK_FAIL=%s: one line, non-zero exit, in %.1f s" % (hook, took),
              "rc %d, %r" % (p.returncode, p.stderr))
        left = left_running(tag)
        check(not left, "--procs STEPQ_BENCH_RANK_FAIL=%s: no rank process left" % hook, str(left))
    p, _ = run(SMALL + ["--procs"], uuid.uuid4().hex, STEPQ_BENCH_RANK_FAIL="1")
    check("[rank 1] stepq bench decode: rank 1 fails" in p.stderr,
          "--procs: a rank's stderr is passed on with its prefix", p.stderr)

    # The parent killed outright (no time to stop its ranks): they end with it.
    tag = uuid.uuid4().hex
    e = dict(os.environ, STEPQ_PROGRESS="off")
    e.pop("STEPQ_BENCH_RANK_FAIL", None)
    e[TAG] = tag
    parent = subprocess.Popen([EXE, "bench", "decode", MAP, "--tp", "2", "--procs"] + LONG,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=e)
    for _ in range(100):
        time.sleep(0.05)
        if len(left_running(tag)) == 3:
            break
    started = len(left_running(tag))
    parent.kill()
    parent.wait()
    for _ in range(100):
        if not left_running(tag):
            break
        time.sleep(0.05)
    check(started == 3 and not left_running(tag),
          "--procs: the ranks end with a parent killed by SIGKILL",
          "%d processes seen, %s left" % (started, left_running(tag)))

    # Refused before any rank starts.
    for args, want in ((["--tp", "5", "--procs"], "do not split 5 ways"),
                       (["--procs", "--rank", "1"], "--rank")):
        p, _ = run(args, uuid.uuid4().hex, STEPQ_BENCH_RANK_FAIL="0")
        lines = p.stderr.strip().splitlines()
        check(p.returncode == 2 and len(lines) == 1 and want in lines[0] and p.stdout == "",
              "bench decode --tp 2 %s: refused in one line before any rank" % " ".join(args),
              "rc %d, %r" % (p.returncode, p.stderr))
    cuda_procs()
    return 1 if failed() else 0


def cuda_procs():
    p, _ = run(CUDA + ["--tp", "1", "--procs", "--json"], uuid.uuid4().hex)
    if p.returncode and "--backend cuda: cannot open a CUDA pool" in p.stderr:
        print("skip --procs on CUDA: no CUDA device here")
        return
    try:
        d = json.loads(p.stdout)
        ok = (p.returncode == 0 and d["tp"] == 1 and len(d["ranks"]) == 1 and
              d["ranks"][0]["backend"] == "cuda" and d["ranks"][0]["cuda_device"] == 0)
    except (ValueError, KeyError, TypeError):
        ok = False
    check(ok, "--tp 1 --procs on CUDA: one rank on device 0", p.stdout[:400] + p.stderr)

    tag = uuid.uuid4().hex
    p, _ = run(CUDA + ["--procs", "--json"], tag)
    lines = p.stderr.strip().splitlines()
    m = re.match(r"stepq bench decode: --tp 2 --procs: 2 ranks need 2 CUDA devices \(one rank "
                 r"per device for NCCL\), this host has (\d+); without --procs, --tp 2 times "
                 r"one rank's share$", lines[0]) if len(lines) == 1 else None
    if p.returncode == 0:
        try:
            ranks = json.loads(p.stdout)["ranks"]
            nccl = any(r["nccl"] for r in ranks)
            ok = len(ranks) == 2 and (not nccl or ranks[0]["cuda_device"] != ranks[1]["cuda_device"])
        except (ValueError, KeyError, TypeError):
            ok = False
        check(ok, "--tp 2 --procs on CUDA: NCCL ranks on distinct devices", p.stdout[:400])
    else:
        check(p.returncode == 2 and m and int(m.group(1)) < 2 and p.stdout == "",
              "--tp 2 --procs on CUDA with one device: refused in one line before any rank",
              "rc %d, %r" % (p.returncode, p.stderr))
    check(not left_running(tag), "--tp 2 --procs on CUDA: no rank process left")


if __name__ == "__main__":
    sys.exit(main())
