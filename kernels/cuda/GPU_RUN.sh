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

$S bench kernels --quick > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench.txt"

NCU="ncu --clock-control none --kernel-name regex:sq_tile --launch-skip 2 --launch-count 1 \
 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
 --section LaunchStats --section Occupancy --section InstructionStats --section SchedulerStats"
STALL="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
$NCU $STALL $S bench kernels --only stepq@6 --batch 512 --shape gdn > "$OUT/ncu_step.txt" 2>&1
$NCU $STALL $S bench kernels --only stepq@6 --batch 512 --shape kda > "$OUT/ncu_kda.txt" 2>&1
$NCU $S bench kernels --only 'stepq@6 pack' --batch 512 --shape kda > "$OUT/ncu_pack.txt" 2>&1
$NCU $STALL $S bench kernels --only bf16 --batch 512 --shape gdn > "$OUT/ncu_bf16.txt" 2>&1
# The peer (flash-linear-attention's fp32 kernels) when a snapshot of its `fla` package
# was carried in the ignored peers/fla folder (see tools/bench_peer_fla.py).
if [ -d peers/fla/fla ]; then
    python3 tools/bench_peer_fla.py --fla peers/fla --json "$OUT/peer.json" > "$OUT/peer.txt" 2>&1
    echo "peer rc=$?" >> "$OUT/peer.txt"
fi
exit 0
