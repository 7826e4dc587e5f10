#!/bin/sh
# GPU run of the CUDA kernels (the lead runs this on the H200 from the repo root
# after: . .devdeps/env.sh && meson setup build-gpu -Dcuda=enabled --buildtype=release
#        && ninja -C build-gpu). Logs go to $OUT (at most 8 files come back).
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
T=build-gpu/tests/kernels_cuda/check_cuda
S=build-gpu/tools/stepq

{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv; date; } > "$OUT/check.txt" 2>&1
$T >> "$OUT/check.txt" 2>&1
echo "check_cuda rc=$?" >> "$OUT/check.txt"

{ SANITIZE=1 compute-sanitizer --tool memcheck --error-exitcode 9 $T 2>&1 | tail -30
  echo "memcheck rc=$?"
  SANITIZE=1 compute-sanitizer --tool racecheck --error-exitcode 9 $T 2>&1 | tail -15
  echo "racecheck rc=$?"; } > "$OUT/sanitize.txt" 2>&1

# bench.json: every row (shipped and prepared variants) for side-by-side comparison
$S bench kernels --quick --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench.txt"

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
# prepared variants (README, "Prepared variants"): rc+s on KDA, the unpack kernel vs the shipped one
ncu_one "kda stepq@6 (rc+s) B=512" sq_tile --only 'stepq@6 (rc+s)' --batch 512 --shape kda
ncu_one "kda stepq@6 unpack (u) B=512" sq_unpack --only 'stepq@6 unpack (u)' --batch 512 --shape kda
ncu_one "kda stepq@6 unpack (shipped) B=512" sq_head --only 'stepq@6 unpack' --batch 512 --shape kda
# The peer (flash-linear-attention's fp32 kernels) when a snapshot of its `fla` package
# was carried in the ignored peers/fla folder (see tools/bench_peer_fla.py).
if [ -d peers/fla/fla ]; then
    python3 tools/bench_peer_fla.py --fla peers/fla --json "$OUT/peer.json" > "$OUT/peer.txt" 2>&1
    echo "peer rc=$?" >> "$OUT/peer.txt"
fi
exit 0
