#!/bin/sh
# GPU run of the CUDA kernels (the lead runs this on the H200 from the repo root
# after: . .devdeps/env.sh && meson setup build-gpu -Dcuda=enabled --buildtype=release
#        && ninja -C build-gpu). Logs go to $OUT (at most 8 files come back):
# check.txt, sanitize.txt, peer.txt, peer.json, bench.txt, bench.json, ncu.txt,
# probe.txt (the half2 design probe), and with FULL=1 the full bench (every batch) in
# bench_full.txt / bench_full.json, or appended to bench.txt (no JSON) where separate
# files would make more than 8.
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
T=build-gpu/tests/checkasm/checkasm
S=build-gpu/tools/stepq

{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv; date; } > "$OUT/check.txt" 2>&1
$T >> "$OUT/check.txt" 2>&1
echo "checkasm rc=$?" >> "$OUT/check.txt"

# sanitize TOOL LINES BINARY ARGS...: the tool's last LINES lines and its own status (a
# pipe into tail would report tail's); the full log is a temporary file, removed after.
sanitize() {
    tool=$1 lines=$2
    shift 2
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$@" > "$OUT/.sanitize.log" 2>&1
    r=$?
    tail -n "$lines" "$OUT/.sanitize.log"
    echo "$tool rc=$r"
    rm -f "$OUT/.sanitize.log"
}
export SANITIZE=1 # checkasm's sanitizer subset
{ sanitize memcheck 30 $T
  sanitize racecheck 15 $T; } > "$OUT/sanitize.txt" 2>&1
unset SANITIZE

# The peer (flash-linear-attention's fp32 kernels) when a snapshot of its `fla` package
# was carried in the ignored peers/fla folder (see tools/scripts/bench_peer_fla.py). It runs
# first, in its own process, so the bench can print it next to its rows (--peer).
PEER=
if [ -d peers/fla/fla ]; then
    python3 tools/scripts/bench_peer_fla.py --fla peers/fla --json "$OUT/peer.json" > "$OUT/peer.txt" 2>&1
    prc=$?
    echo "peer rc=$prc" >> "$OUT/peer.txt"
    [ $prc -eq 0 ] && [ -s "$OUT/peer.json" ] && PEER=$OUT/peer.json
fi

bench() { # text file, bench arguments...
    f=$1
    shift
    if [ -n "$PEER" ]; then
        $S bench kernels --peer "$PEER" "$@" >> "$f" 2>&1
        r=$?
        if [ $r -eq 2 ]; then # the bench rejected the peer file (the reason is in $f)
            echo "bench rc=2 with --peer $PEER; again without it" >> "$f"
            $S bench kernels "$@" >> "$f" 2>&1
            r=$?
        fi
    else
        $S bench kernels "$@" >> "$f" 2>&1
        r=$?
    fi
    echo "bench rc=$r" >> "$f"
}
: > "$OUT/bench.txt"
bench "$OUT/bench.txt" --quick --json "$OUT/bench.json"
if [ "${FULL:-0}" = 1 ]; then
    # Two more files next to those so far, ncu.txt and probe.txt, unless that makes more
    # than 8 (with the peer's two it makes 10): then the text goes into bench.txt, without JSON.
    n=$(ls "$OUT" | wc -l)
    if [ $((n + 4)) -le 8 ]; then
        : > "$OUT/bench_full.txt"
        bench "$OUT/bench_full.txt" --json "$OUT/bench_full.json"
    else
        echo "=== full bench (FULL=1; its JSON is not kept: at most 8 files come back)" >> "$OUT/bench.txt"
        bench "$OUT/bench.txt"
    fi
fi

# Every ncu report goes to one file (at most 8 files come back from a device run).
NCU="ncu --clock-control none --launch-skip 2 --launch-count 1 \
 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
 --section LaunchStats --section Occupancy --section InstructionStats --section SchedulerStats"
STALL="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
N="$OUT/ncu.txt"
: > "$N"
ncu_one() { # title, kernel regex, bench arguments...
    t=$1 k=$2
    shift 2
    echo "=== $t" >> "$N"
    $NCU --kernel-name "regex:$k" $STALL $S bench kernels "$@" >> "$N" 2>&1
}
ncu_one "gdn stepq@6 B=512" sq_tile --only stepq@6 --batch 512 --shape gdn
ncu_one "kda stepq@6 B=512" sq_tile --only stepq@6 --batch 512 --shape kda
ncu_one "kda stepq@6 pack B=512" sq_tile --only 'stepq@6 pack' --batch 512 --shape kda
ncu_one "gdn bf16 B=512" sq_tile --only bf16 --batch 512 --shape gdn
# The unpack kernel (sq_unpack_kernel, unpack_kernel.cuh), shipped for every unpack.
ncu_one "gdn stepq@6 unpack B=512" sq_unpack --only 'stepq@6 unpack' --batch 512 --shape gdn
ncu_one "kda stepq@6 unpack B=512" sq_unpack --only 'stepq@6 unpack' --batch 512 --shape kda
ncu_one "gdn stepq@6 unpack [V,K] B=512" sq_unpack --only 'stepq@6 unpack [V,K]' --batch 512 --shape gdn
# The fp16 step (arith fp16, sq_f16_kernel), and its instructions and warp-stall samples per
# barrier-delimited phase (tools/scripts/ncu_phases.py; phases 0-7, 8-15, 16-23 are the stepq@6
# map's 6-, 8- and 4-bit paths, 24-30 its pivot head), appended to the same file.
ncu_one "gdn stepq@6 fp16 B=512" sq_f16 --only 'stepq@6 fp16' --batch 512 --shape gdn
ncu_one "gdn stepq@6 fp16 norefit B=512" sq_f16 --only 'stepq@6 fp16 norefit' --batch 512 --shape gdn
echo "=== gdn stepq@6 fp16 B=512: phases" >> "$N"
if ncu --clock-control none --kernel-name regex:sq_f16 --launch-skip 2 --launch-count 1 \
    --section SourceCounters -f -o "$OUT/.f16" $S bench kernels --only 'stepq@6 fp16' --batch 512 \
    --shape gdn > /dev/null 2>&1 &&
    ncu -i "$OUT/.f16.ncu-rep" --page source --csv --print-source sass > "$OUT/.f16.csv" 2>> "$N"; then
    python3 tools/scripts/ncu_phases.py "$OUT/.f16.csv" --groups \
        "inputs=0,8,16,24;norm=1,9,17,25;step1=2,10,18;u=3,11,19;steps2-5=4,12,20;qf=5,13,21;step6=6,14,22;refit=7,15,23;pivot=26-30" \
        >> "$N" 2>&1
else
    echo "source counters not collected" >> "$N"
fi
rm -f "$OUT/.f16.ncu-rep" "$OUT/.f16.csv"

# The half2 design probe of the next packed step (kernels/cuda/probe/fp16_step.cu, built with
# the tree; not part of the library): its kernels side by side at B = 512 and 1, then its
# sanitizer runs at B = 8 with one timed launch per kernel (STEPQ_PROBE_REPS=1).
P=build-gpu/kernels/cuda/stepq-fp16-probe
{ for b in 512 1; do
      $P $b
      echo "probe B=$b rc=$?"
  done
  export STEPQ_PROBE_REPS=1
  sanitize memcheck 3 $P 8
  sanitize racecheck 3 $P 8
  unset STEPQ_PROBE_REPS; } > "$OUT/probe.txt" 2>&1
exit 0
