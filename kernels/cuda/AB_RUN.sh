#!/bin/bash
# Same-run A/B of compile-time kernel variants on the GPU host.
#
#   kernels/cuda/AB_RUN.sh build     on the development machine (nvcc, no GPU needed): builds the
#                                    default tree and each variant below in release, in
#                                    build-ab-NAME, and copies what the device needs into the
#                                    ignored out/ab/NAME/ (stepq; checkasm where san_tests names
#                                    checks; base also stepq-div-probe). About 3.5 minutes a
#                                    variant on 2 cores. One variant is about 10-20 MB and a run
#                                    carries 64 MiB at most, so carry the variants of one call
#                                    only: ["out/ab/base", "out/ab/packdiv", ...].
#   On the device (the `run` tool, carry ".devdeps" and the variants' folders), each under its
#   10-minute limit, over the variants of VARIANTS that were carried (out/ab/NAME present):
#   kernels/cuda/AB_RUN.sh checks    checkasm (all; its output in checkasm-NAME.txt) and
#                                    compute-sanitizer memcheck / racecheck (SANITIZE=1) over the
#                                    checks san_tests names, for each variant that has them, then
#                                    stepq-div-probe (all 2^46 pairs); CHECKASM=0, SAN=0 and PROBE=0
#                                    skip a part (to put the A/B between them in a short call);
#   kernels/cuda/AB_RUN.sh ab        B = 512 and B = 1 in a CUDA graph, every row rows_of names, on
#                                    base and on each variant naming it, interleaved, two rounds;
#   kernels/cuda/AB_RUN.sh batches   every batch of the BATCH_ROWS pairs (variant|shape|row);
#   kernels/cuda/AB_RUN.sh run       all three.
#   Results in $OUT (checks.txt, checkasm-NAME.txt, ab512.txt, batches.txt; at most 8 files come
#   back), key lines and timestamps on stdout. VARIANTS picks a subset ("base packdiv": base first).
#
# The variants are the switches the kernels carry until a GPU run decides them
# (kernels/cuda/README.md names each one's section):
#   base  the default build
#   packdiv -DSQ_FP8_PACK_SQDIV=1: sq_div in the fp8 pack too (fp8_kernel.cuh)
#   packdiv2 -DSQ_FP8_PACK_SQDIV=1 -DSQ_F8BMIN_BLOCKS=2: the same, the pack from bf16 at 2 blocks
#             per SM (128 registers) instead of 4
#   f16pref -DSQ_F16_PIVOT_PREFETCH=1: the fp16 kernel's pivot head rows asked of L2 before its
#             input phase (f16_kernel.cuh)
#   bulk  -DSQ_STAGE_BULK=1: the fused packed step stages its head block by one bulk copy (TMA)
#             from thread 0 (tile_kernel.cuh, common.cuh sq_bulk_stage)
# (Session 20 ran this script's first version on an H100: sq_div in the fp8 step and the 16 KiB
# bf16 [V,K] unpack buffer became the default, the L2 prefetch was removed; the files are in
# tools/results/bench-h100/session20/. Session 21 removed its column-strip variant, strip, after
# ncu: kernels/cuda/README.md, "Tried and removed: the packed step on column strips"; session 22
# its variant pivdirect, the GDN pivot head's rows unstaged, 1.5-2.7% slower: "The GDN pivot
# head's own item".)
set -o pipefail
VARIANTS=${VARIANTS:-"base packdiv packdiv2 f16pref bulk"}
flags_of() {
    case $1 in
    base) echo "" ;;
    packdiv) echo "-DSQ_FP8_PACK_SQDIV=1" ;;
    packdiv2) echo "-DSQ_FP8_PACK_SQDIV=1 -DSQ_F8BMIN_BLOCKS=2" ;;
    f16pref) echo "-DSQ_F16_PIVOT_PREFETCH=1" ;;
    bulk) echo "-DSQ_STAGE_BULK=1" ;;
    *) echo "AB_RUN.sh: unknown variant '$1'" >&2; exit 2 ;;
    esac
}
# variants whose arithmetic or data path differs get checkasm and the sanitizers over these checks
san_tests() {
    case $1 in
    packdiv) echo "fp8" ;;
    packdiv2) echo "fp8" ;;
    f16pref) echo "pivot" ;;
    bulk) echo "decode" ;;
    esac
}
checked() { [ -n "$(san_tests "$1")" ]; }
# the variants of VARIANTS whose binaries were carried to the device
present() { for v in $VARIANTS; do if [ -x "out/ab/$v/stepq" ]; then printf '%s ' "$v"; fi; done; }

build() {
    export PATH=/usr/local/cuda/bin:$PATH
    for v in $VARIANTS; do
        f=$(flags_of "$v") || exit 2
        d=build-ab-$v
        [ -d "$d" ] || meson setup "$d" -Dcuda=enabled --buildtype=release > /dev/null || exit 1
        touch kernels/cuda/layer.cu # the flags are not part of ninja's command line
        echo "building $v ($f)" >&2
        NVCC_APPEND_FLAGS="$f" meson compile -C "$d" tools/stepq tests/checkasm/checkasm \
            kernels/cuda/stepq-div-probe > "$d/ab-build.log" 2>&1 || { tail -20 "$d/ab-build.log"; exit 1; }
        mkdir -p "out/ab/$v"
        cp "$d/tools/stepq" "out/ab/$v/"
        if checked "$v"; then cp "$d/tests/checkasm/checkasm" "out/ab/$v/"; fi
        if [ "$v" = base ]; then cp "$d/kernels/cuda/stepq-div-probe" out/ab/base/; fi
        strip out/ab/"$v"/* # host symbols only: the carry limit is tight
    done
    du -sh out/ab/* >&2
}

# The device modes' common start: the environment, $OUT, the carried variants, the clock.
device_setup() {
    . .devdeps/env.sh
    OUT=${OUT:-out/ab-results}
    mkdir -p "$OUT"
    B=out/ab
    VARIANTS=$(present)
    echo "variants here: $VARIANTS"
    T0=$(date +%s)
}
ts() { echo "[t+$(($(date +%s) - T0))s] $*"; } # a timestamped progress line

checks() {
    device_setup
    C=$OUT/checks.txt
    nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$C"
    for v in $VARIANTS; do
        [ -x $B/$v/checkasm ] || continue
        if [ "${CHECKASM:-1}" = 1 ]; then
            timeout 150 $B/$v/checkasm > "$OUT/checkasm-$v.txt" 2>&1
            echo "checkasm-$v rc $?" >> "$OUT/checkasm-$v.txt"
            grep -v "^ok\|^  \|^$" "$OUT/checkasm-$v.txt" | head -40 | tee -a "$C"
        fi
        [ "${SAN:-1}" = 1 ] || continue
        for t in $(san_tests "$v"); do for tool in memcheck racecheck; do
            SANITIZE=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 \
                $B/$v/checkasm --test "${t//_/ }" > /tmp/san.txt 2>&1
            echo "$tool $v --test $t rc $?" >> /tmp/san.txt
            tail -2 /tmp/san.txt | tee -a "$C"
        done; done
        ts "checks $v"
    done
    if [ "${PROBE:-1}" = 1 ] && [ -x $B/base/stepq-div-probe ]; then
        timeout 240 $B/base/stepq-div-probe >> "$C" 2>&1
        echo "stepq-div-probe rc $?" | tee -a "$C"
        ts probe
    fi
    ts checks-done
}

# The bench rows each variant changes (the A/B runs them on base and on every variant naming them).
rows_of() {
    case $1 in
    packdiv | packdiv2) printf '%s\n' "fp8 pack" "fp8 pack bf16" "fp8 pack [V,K]" "fp8 pack bf16 [V,K]" ;;
    f16pref) printf '%s\n' "stepq@6 fp16" "stepq@4 fp16" ;;
    bulk) printf '%s\n' "stepq@6" "stepq@4" "uniform@6" ;;
    esac
}
shapes_of() { if [ "$1" = f16pref ]; then echo gdn; else echo "gdn kda"; fi; } # KDA: no pivot head

ab() {
    device_setup
    declare -A who
    local order=()
    for v in $VARIANTS; do
        [ "$v" = base ] && continue
        for sh in $(shapes_of "$v"); do
            while IFS= read -r L; do
                k="$sh|$L"
                [ -n "${who[$k]}" ] || order+=("$k")
                who[$k]="${who[$k]} $v"
            done < <(rows_of "$v")
        done
    done
    R=$OUT/ab512.txt
    for round in 1 2; do
        for k in "${order[@]}"; do
            sh=${k%%|*} L=${k#*|}
            for v in base ${who[$k]}; do
                $B/$v/stepq bench kernels --only "$L" --shape $sh --batch 512 | grep " 512 " |
                    sed "s/^/$sh $v r$round /" | tee -a "$R"
                $B/$v/stepq bench kernels --only "$L" --shape $sh --batch 1 --graph | grep " 1 " |
                    sed "s/^/$sh $v r$round graph /" | tee -a "$R"
            done
        done
        ts "ab512 round $round"
    done
}

# Every batch (1..512) of the rows where a variant must be no slower anywhere: "variant|shape|row".
batches() {
    device_setup
    while IFS= read -r k; do
        [ -n "$k" ] || continue
        v=${k%%|*} rest=${k#*|}
        sh=${rest%%|*} L=${rest#*|}
        case " $VARIANTS " in *" $v "*) ;; *) continue ;; esac
        for b in base $v; do
            $B/$b/stepq bench kernels --only "$L" --shape $sh | grep -E "^device|[0-9]%" |
                sed "s/^/$sh $b /" >> "$OUT/batches.txt"
        done
        ts "batches $k"
    done <<< "${BATCH_ROWS:-packdiv|gdn|fp8 pack bf16
packdiv2|gdn|fp8 pack bf16
f16pref|gdn|stepq@6 fp16
bulk|gdn|stepq@6
bulk|kda|stepq@6}"
}


case $1 in
build) build ;;
checks) checks ;;
ab) ab ;;
batches) batches ;;
run) checks && ab && batches ;;
*) echo "usage: kernels/cuda/AB_RUN.sh build|checks|ab|batches|run (VARIANTS, BATCH_ROWS: see the header)" >&2; exit 2 ;;
esac
