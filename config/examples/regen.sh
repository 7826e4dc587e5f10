#!/bin/sh
# Regenerates the example maps of this folder with `stepq mkmap`.
#   config/examples/regen.sh build/tools/stepq config/examples
# tests/config/check_examples.sh runs it into a temporary folder and fails
# when the checked-in files differ from what the current writer produces.
set -eu
stepq=$1
out=$2

mk() {
    name=$1
    shift
    "$stepq" mkmap "$@" --out "$out/$name.json"
}

for shape in qwen3.8-27b qwen3-next-80b-a3b kimi-linear-48b-a3b tiny-gdn; do
    mk "$shape.fp32" --shape "$shape" --method fp32
    for b in 4 6 8; do
        mk "$shape.uniform-$b" --shape "$shape" --method uniform --bits "$b"
    done
done
mk qwen3.8-27b.dsq-6 --shape qwen3.8-27b --method dsq --bits 6
mk kimi-linear-48b-a3b.dsq-4 --shape kimi-linear-48b-a3b --method dsq --bits 4
mk qwen3-next-80b-a3b.fp8 --shape qwen3-next-80b-a3b --method fp8
mk kimi-linear-48b-a3b.fp8 --shape kimi-linear-48b-a3b --method fp8
# 32 fp16 pivot heads (1.39% of 2304) and a {4,6,8} mix: the paper's serving layout size.
mk qwen3.8-27b.stepq-6-layout --shape qwen3.8-27b --method stepq --bits 6 --pivots 32
