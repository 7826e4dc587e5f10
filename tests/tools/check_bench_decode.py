#!/usr/bin/env python3
"""stepq bench decode on the host backend:
  - --json prints one JSON document with the fp32, bf16 and map rows of every batch;
  - the state bytes of each row are `stepq inspect`'s allocated state bytes x B (for the
    map, and for the bundled fp32 map of the same shape: the dense comparison pools are
    the maps stepq_map_create makes), and the slots are state + conv;
  - the same run twice gives the same numbers except the timings (outputs included);
  - bad input is refused before any work with one line and a non-zero status: an unknown
    preset, a --tp the heads do not split into, a batch over --budget-gib, --backend cuda
    without a device (skipped where a device exists);
  - the default host run is a reduced one and says so, and says it measures the
    recurrent-state path only;
  - progress on stderr counts request tokens (batch x tokens per run), not runs;
  - README's first command ends in the main job that .ci/run runs, and it is this command.
Usage: check_bench_decode.py STEPQ_EXE SOURCE_ROOT"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_checks import bench, check, failed  # noqa: E402

EXE, ROOT = sys.argv[1], sys.argv[2]
MAP = os.path.join(ROOT, "config", "examples", "qwen3.8-27b.stepq-6-layout.json")
FP32 = os.path.join(ROOT, "config", "examples", "qwen3.8-27b.fp32.json")
ENV = dict(os.environ, STEPQ_PROGRESS="off")
SMALL = ["--backend", "host", "--batch", "1,3", "--tokens", "3", "--layers", "1"]
TIMINGS = {"tokens_per_s", "ms_per_step", "decode_s", "run_s", "speedup_vs_fp32"}


def run(args):
    return bench(EXE, args, ENV)



def untimed(d):
    if isinstance(d, dict):
        return {k: untimed(v) for k, v in d.items() if k not in TIMINGS}
    if isinstance(d, list):
        return [untimed(v) for v in d]
    return d


def sourceless(states):
    """The states without the map each comes from (a file path or a preset name)."""
    return [{k: v for k, v in s.items() if k != "source"} for s in states or []]


def inspect(path):
    p = subprocess.run([EXE, "inspect", path, "--json"], capture_output=True, text=True)
    return json.loads(p.stdout)


def main():
    p = run([MAP] + SMALL + ["--json"])
    try:
        d = json.loads(p.stdout)
        rows = {b["batch"]: {r["label"]: r for r in b["rows"]} for b in d["batches"]}
        ok = (p.returncode == 0 and sorted(rows) == [1, 3] and
              all(sorted(r) == ["bf16", "fp32", "stepq@6"] for r in rows.values()) and
              all(r["ran"] and r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and
                  r["health"] == 0 for b in rows.values() for r in b.values()) and
              d["backend"] == "host" and d["layers_timed"] == 1 and d["reduced"])
    except (ValueError, KeyError, TypeError) as e:
        d, rows, ok = None, {}, False
        print(e)
    check(ok, "bench decode --json: every batch's fp32, bf16 and map rows", p.stdout[:400] + p.stderr)
    if not d:
        return 1

    # Memory: inspect's numbers x B, for the map and for the fp32 map of the same shape.
    states = {s["label"]: s for s in d["states"]}
    for label, path in (("stepq@6", MAP), ("fp32", FP32)):
        ins = inspect(path)
        s = states[label]
        ok = (s["state_bytes_per_request"] == ins["state_bytes_allocated"] and
              s["state_bytes_compact_per_request"] == ins["state_bytes_compact"] and
              s["conv_bytes_per_request"] == ins["conv_bytes"] and
              s["slot_bytes"] == ins["state_bytes_allocated"] + ins["conv_bytes"] and
              all(rows[b][label]["state_bytes"] == b * ins["state_bytes_allocated"] and
                  rows[b][label]["reserved_pool_bytes"] == (5 * b + 1) * s["slot_bytes"]
                  for b in rows))
        check(ok, "bench decode %s: state bytes = stepq inspect's x B" % label,
              "%s vs %s" % (s, ins))
    # bf16 is half of fp32's state.
    check(states["bf16"]["state_bytes_per_request"] * 2 == states["fp32"]["state_bytes_per_request"],
          "bench decode bf16: half the fp32 state")
    # The largest batch in the budget: slots of the budget / 5.
    budget = d["budget_bytes"]
    for s in d["states"]:
        want = (int(budget // s["slot_bytes"]) - 1) // 5
        check(s["max_batch"] == want, "bench decode %s: max batch %d in the budget" %
              (s["label"], want), str(s["max_batch"]))

    # Determinism: the same run again, the same numbers except the timings.
    q = run([MAP] + SMALL + ["--json"])
    check(q.returncode == 0 and untimed(json.loads(q.stdout)) == untimed(d),
          "bench decode: two runs give the same numbers but the timings", q.stderr)
    sums = [r["output_checksum"] for b in rows.values() for r in b.values()]
    check(all(x > 0 for x in sums), "bench decode: the outputs are not zero", str(sums))
    # The three pools ran the same tokens: their last outputs' sums of |o| agree to the
    # states' rounding (bf16: 2^-8 relative per value, averaged out; stepq@6: 3 steps of 31).
    for b, r in rows.items():
        f, h, m = (r[k]["output_checksum"] for k in ("fp32", "bf16", "stepq@6"))
        check(abs(h / f - 1) < 1e-3 and abs(m / f - 1) < 3.0 / 31,
              "bench decode B=%d: fp32, bf16 and stepq@6 decode the same tokens" % b,
              "%g %g %g" % (f, h, m))
    # KDA (per-row gates and units) on one rank of a TP split.
    p = run(["kimi-linear-48b-a3b", "--tp", "4"] + SMALL + ["--json"])
    try:
        k = json.loads(p.stdout)
        ok = (p.returncode == 0 and k["arch"] == "kda" and k["num_v_heads_rank"] == 8 and
              all(r["ran"] and r["output_checksum"] > 0 for b in k["batches"] for r in b["rows"]))
    except (ValueError, KeyError):
        ok = False
    check(ok, "bench decode kimi-linear-48b-a3b --tp 4: the KDA rows", p.stdout[:300] + p.stderr)

    # The preset builds the bundled map: the same bytes and the same outputs.
    q = run(["qwen3.8-27b"] + SMALL + ["--json"])
    pd = json.loads(q.stdout) if q.returncode == 0 else {}
    check(pd.get("preset") == "qwen3.8-27b" and
          sourceless(pd.get("states")) == sourceless(d["states"]) and
          untimed(pd.get("batches")) == untimed(d["batches"]),
          "bench decode qwen3.8-27b: the preset is the bundled stepq@6 layout map", q.stderr)

    # The table of the default host run: reduced, and what it measures.
    p = run([MAP, "--backend", "host", "--tokens", "2", "--batch", "1"])
    out = p.stdout
    check(p.returncode == 0 and "REDUCED" in out and "recurrent-state path only" in out and
          "--full" in out and "stepq@6" in out and "tokens/s" in out,
          "bench decode table: reduced, says what it measures", out + p.stderr)

    # Progress in request tokens (B x T per run), so that the ETA weighs a run by its batch:
    # batches 1 and 3, 3 tokens, 3 states x (1 warm-up + 3 runs) = 144 tokens, not 24 runs.
    p = subprocess.run([EXE, "bench", "decode", MAP] + SMALL, capture_output=True, text=True,
                       env=dict(ENV, STEPQ_PROGRESS="lines", STEPQ_PROGRESS_INTERVAL="0"),
                       timeout=300)
    lines = p.stderr.strip().splitlines()
    done = "stepq bench decode: 144/144 tokens done"
    check(p.returncode == 0 and lines and lines[-1].startswith(done) and
          all(" tokens (" in l for l in lines[:-1]) and "tokens (" not in p.stdout,
          "bench decode progress: request tokens, weighted by batch", p.stderr[-300:])

    # README command 1's main job is the line .ci/run runs.
    readme = open(os.path.join(ROOT, "README.md")).read()
    first = readme.split("```sh\n", 1)[1].split("\n", 1)[0]
    job = first.rsplit(" && ", 1)[-1]
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    check(job.startswith("./build/tools/stepq bench decode ") and job in ci,
          "README command 1's main job is .ci/run's", job)

    # A short warm-up (--warmup-tokens): the header and the JSON say so, the timed runs keep T.
    p = run([MAP, "--batch", "1", "--tokens", "6", "--warmup-tokens", "2", "--layers", "1",
             "--runs", "1", "--json"])
    try:
        j = json.loads(p.stdout) if p.returncode == 0 else {}
    except ValueError:
        j = {}
    check(j.get("warmup_tokens") == 2 and j.get("generated_tokens") == 6 and j.get("warmup") == 1,
          "bench decode --warmup-tokens 2: recorded in the JSON", p.stderr[-300:])
    p = run([MAP, "--batch", "1", "--tokens", "6", "--warmup-tokens", "2", "--layers", "1",
             "--runs", "1"])
    check(p.returncode == 0 and "1 warm-up (2 tokens) + 1 runs" in p.stdout,
          "bench decode --warmup-tokens 2: the header says the warm-up's length", p.stdout[:600])
    p = run([MAP, "--batch", "1", "--tokens", "4", "--warmup-tokens", "9", "--layers", "1",
             "--runs", "1", "--json"])
    j = json.loads(p.stdout) if p.returncode == 0 else {}
    check(j.get("warmup_tokens") == 4, "bench decode --warmup-tokens above --tokens: the warm-up is T",
          p.stderr[-300:])

    # Refusals before any work: one line, non-zero exit, nothing on stdout.
    cases = [
        (["qwen9-1b"], "unknown preset"),
        ([MAP, "--tp", "5"], "16 q/k heads and 48 value heads"),
        ([MAP, "--batch", "600", "--budget-gib", "8"], "--budget-gib 8"),
        (["kimi-linear-48b-a3b", "--tp", "3"], "--tp 3"),
    ]
    probe = run([MAP, "--backend", "cuda", "--batch", "1", "--tokens", "1", "--layers", "1",
                 "--runs", "1", "--warmup", "0"])
    if probe.returncode == 0:
        print("skip --backend cuda without a device: this machine has one")
    else:
        cases.append(([MAP, "--backend", "cuda"], "--backend cuda"))
    for args, want in cases:
        p = run(args)
        lines = p.stderr.strip().splitlines()
        check(p.returncode != 0 and len(lines) == 1 and want in lines[0] and p.stdout == "",
              "bench decode %s: refused in one line" % " ".join(args[1:] or args),
              "rc %d, %r" % (p.returncode, p.stderr))
    return 1 if failed() else 0


if __name__ == "__main__":
    sys.exit(main())
