#!/usr/bin/env bash
# The calibration study of one model (tiny-gdn by default; MODEL=.../tiny-kda for KDA), end to end on the GPU host:
# capture WikiText-2 traces, calibrate every method on VALID, evaluate on TEST
# (trace replay with `stepq eval`, and excess NLL with the model in the loop).
# Big traces stay in a scratch folder; only small results go to $OUT.
#
#   tools/scripts/run_study.sh STAGE...     STAGE: calib, eval, nll, all; eval4 / eval6 and
#   nll4 / nll6 run the 4-bit and the 6/8-bit halves (to fit 10-minute device commands)
# Environment: RESULTS (results, default out/study), OUT (when set, e.g. the device
# tool's output folder: the results are packed there as study.tgz plus the
# readable tables, a handful of files), BUILD (default build-gpu),
# SHARED (default ../shared; or MODEL, VALID_TEXT, TEST_TEXT one by one), SCRATCH (traces, default out/study-scratch: ignored by git, so it survives between
# device calls on a warm host),
# VALID_STREAMS (32), TEST_STREAMS (16), SEQ (2048), NLL_STREAMS (16),
# PREFILL (512), DECODE (1536), THREADS (online CPUs), VARIANTS (1; 0 leaves out the stepq-nopiv and
# stepq-paper comparison maps), MAPS (a folder of ready maps, e.g.
# config/calibrated/tiny-gdn: eval / nll stages then copy them instead of capturing and
# calibrating; their SHA256SUMS are checked), STEPQ_ARGS (more `stepq calibrate` options for
# the stepq@4/6/8 maps, e.g. "--row-split 0.75 --decode-fit norefit": tools/CALIBRATION.md's
# rule for tiny-kda; word-split).
# Calibration is deterministic, so `calib` run in two sessions gives byte-identical
# maps (the script prints their sha256).
set -euo pipefail
cd "$(dirname "$0")/../.."
PACK=${OUT:-}
OUT=${RESULTS:-out/study}
BUILD=${BUILD:-build-gpu}
SHARED=${SHARED:-../shared}
SCRATCH=${SCRATCH:-out/study-scratch}
VALID_STREAMS=${VALID_STREAMS:-32}
TEST_STREAMS=${TEST_STREAMS:-16}
SEQ=${SEQ:-2048}
NLL_STREAMS=${NLL_STREAMS:-16}
PREFILL=${PREFILL:-512}
DECODE=${DECODE:-1536}
THREADS=${THREADS:-$(nproc)}
VARIANTS=${VARIANTS:-1}
MODEL=${MODEL:-$SHARED/models/tiny-gdn}
NAME=${NAME:-$(basename "$MODEL")}
VALID_TEXT=${VALID_TEXT:-$SHARED/data/wikitext2-valid.txt}
TEST_TEXT=${TEST_TEXT:-$SHARED/data/wikitext2-test.txt}
STEPQ=$BUILD/tools/stepq
export STEPQ_PLOT_SCRIPT=${STEPQ_PLOT_SCRIPT:-$PWD/tools/scripts/plot.py}
mkdir -p "$OUT/maps" "$OUT/reports" "$SCRATCH"
[ $# -gt 0 ] || set -- all

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/study.log" >&2; }

capture() { # split segments seg_len prefix
    local split=$1 n=$2 len=$3 prefix=$4 text=$VALID_TEXT
    [ "$split" = test ] && text=$TEST_TEXT
    if ! ls "$prefix"-000.safetensors >/dev/null 2>&1; then
        log "capture $split: $n x $len"
        python3 tools/scripts/capture_traces.py --model "$MODEL" --text "$text" \
            --split "$split" --segments "$n" --seg-len "$len" --batch 8 --out "$prefix" --check \
            2>&1 | tee -a "$OUT/study.log"
    fi
}

calib() {
    capture valid "$VALID_STREAMS" "$SEQ" "$SCRATCH/valid"
    local T=("$SCRATCH"/valid-*.safetensors)
    for m in fp32 bf16 fp8; do
        "$STEPQ" calibrate --trace "${T[@]}" --method $m --budget 4 --out "$OUT/maps/$m.json" \
            --model-name "$NAME" 2>&1 | tee -a "$OUT/study.log"
    done
    for b in 4 6 8; do
        for m in uniform dsq spatial temporal stepq; do
            [ $b = 8 ] && [ $m != uniform ] && continue
            log "calibrate $m@$b"
            extra=()
            [ $m = stepq ] && read -r -a extra <<< "${STEPQ_ARGS:-}"
            "$STEPQ" calibrate --trace "${T[@]}" --method $m --budget $b --threads "$THREADS" \
                "${extra[@]}" --model-name "$NAME" --out "$OUT/maps/$m@$b.json" \
                --report "$OUT/reports/$m@$b.json" 2>&1 | tee -a "$OUT/study.log"
        done
    done
    # Variants kept for comparison (VARIANTS=0 skips them): no pivots; the paper's rule
    # (lifetime-only, state MSE, B4 = {2,4,6,8}, B6 = {4,6,8}).
    for b in 4 6; do
        [ "$VARIANTS" = 1 ] || break
        "$STEPQ" calibrate --trace "${T[@]}" --method stepq --budget $b --threads "$THREADS" \
            --pivot-fraction 0 --model-name "$NAME" \
            --out "$OUT/maps/stepq-nopiv@$b.json" 2>&1 | tee -a "$OUT/study.log"
        c=$([ $b = 4 ] && echo 2,4,6,8 || echo 4,6,8)
        "$STEPQ" calibrate --trace "${T[@]}" --method stepq --budget $b --threads "$THREADS" \
            --distortion mse --lifetime gate --normalize none --candidates $c --model-name "$NAME" \
            --out "$OUT/maps/stepq-paper@$b.json" 2>&1 | tee -a "$OUT/study.log"
    done
    (cd "$OUT/maps" && sha256sum ./*.json | sed 's# \./# #' | tee SHA256SUMS)
    python3 tools/scripts/map_report.py "stepq@4=$OUT/reports/stepq@4.json" "stepq@6=$OUT/reports/stepq@6.json" \
        "temporal@6=$OUT/reports/temporal@6.json" --markdown "$OUT/bits-pivots.md" >/dev/null
}

MAPS_ORDER="fp32 bf16 uniform@4 dsq@4 spatial@4 temporal@4 stepq@4 stepq-nopiv@4 stepq-paper@4 uniform@6 dsq@6 spatial@6 temporal@6 stepq@6 stepq-nopiv@6 stepq-paper@6 uniform@8 fp8"
[ "$VARIANTS" = 1 ] || MAPS_ORDER=$(echo "$MAPS_ORDER" | tr ' ' '\n' | grep -v -e -nopiv -e -paper | tr '\n' ' ')

need_maps() {
    local n
    if [ ! -f "$OUT/maps/SHA256SUMS" ]; then
        if [ -n "${MAPS:-}" ]; then
            log "maps: from $MAPS"
            (cd "$MAPS" && sha256sum -c --quiet SHA256SUMS)
            cp "$MAPS"/*.json "$MAPS/SHA256SUMS" "$OUT/maps/"
        else
            calib
        fi
    fi
    for n in $MAPS_ORDER; do
        [ -f "$OUT/maps/$n.json" ] || { log "missing map $OUT/maps/$n.json"; exit 1; }
    done
}

evalstage() { # which: 4 (fp32, bf16 and the 4-bit maps), 6 (fp32 and the 6-, 8-bit maps), all
    need_maps
    capture test "$TEST_STREAMS" "$SEQ" "$SCRATCH/test"
    local which=${1:-all} M=()
    for n in $MAPS_ORDER; do
        case $which in
        4) [[ $n == *@4 || $n == fp32 || $n == bf16 ]] || continue ;;
        6) [[ $n == *@4 || $n == bf16 ]] && continue ;;
        esac
        M+=("$OUT/maps/$n.json")
    done
    mkdir -p "$OUT/plots-$which"
    log "eval on test ($which)"
    "$STEPQ" eval --map "${M[@]}" --trace "$SCRATCH"/test-*.safetensors --threads "$THREADS" \
        --json "$OUT/eval-test-$which.json" --plot "$OUT/plots-$which" --classes \
        2>>"$OUT/study.log" | tee "$OUT/eval-test-$which.txt"
    # Where the errors come from, per layer and per head: stepq against temporal (same
    # per-unit widths, row scales only) at each budget evaluated; appended to the table.
    local pairs=() b
    for b in 4 6; do
        [[ " ${M[*]} " == *"/stepq@$b.json "* && " ${M[*]} " == *"/temporal@$b.json "* ]] &&
            pairs+=(--pair "stepq@$b,temporal@$b")
    done
    if [ ${#pairs[@]} -gt 0 ]; then
        { echo; python3 tools/scripts/eval_breakdown.py "$OUT/eval-test-$which.json" "${pairs[@]}"; } \
            >>"$OUT/eval-test-$which.txt"
    fi
}

nll() { # which: 4 (bf16 + the 4-bit maps), 6 (the 6- and 8-bit maps), all
    need_maps
    local which=${1:-all} A=() nb=()
    for n in $MAPS_ORDER; do
        case $n in fp32|bf16) continue ;; esac
        case $which in
        4) [[ $n == *@4 ]] || continue ;;
        6) [[ $n == *@4 ]] && continue ;;
        esac
        A+=(--map "$n=$OUT/maps/$n.json")
    done
    [ "$which" = 6 ] && nb=(--no-bf16)
    log "nll on test ($which)"
    PYTHONUNBUFFERED=1 python3 tools/scripts/nll_eval.py --model "$MODEL" --text "$TEST_TEXT" \
        --streams "$NLL_STREAMS" --prefill "$PREFILL" --decode "$DECODE" \
        --shim "$BUILD/tools/libstepq_replay_shim.so" --threads "$THREADS" "${A[@]}" "${nb[@]}" \
        --json "$OUT/nll-test-$which.json" --markdown "$OUT/nll-test-$which.md" ${NLL_ARGS:-} 2>&1 | tee -a "$OUT/study.log"
}

# Packs what exists so far into $PACK: called after every stage, so a device
# command that hits its time limit in a later stage still returns the earlier ones.
pack() {
    [ -n "$PACK" ] || return 0
    mkdir -p "$PACK"
    tar czf "$PACK/study.tgz" -C "$OUT" .
    for f in bits-pivots.md eval-test-all.txt eval-test-4.txt eval-test-6.txt nll-test-all.md nll-test-4.md \
        nll-test-6.md study.log; do
        [ -f "$OUT/$f" ] && cp "$OUT/$f" "$PACK/"
    done
    return 0
}

# A failing stage (set -e) still packs what the earlier ones left.
trap pack EXIT
for stage in "$@"; do
    case $stage in
    calib) calib ;;
    eval) evalstage all ;;
    eval4) evalstage 4 ;;
    eval6) evalstage 6 ;;
    nll) nll all ;;
    nll4) nll 4 ;;
    nll6) nll 6 ;;
    all) calib; evalstage all; nll all ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
    pack
done
log "done: $*"
[ -n "$PACK" ] && ls -la "$PACK"
exit 0
