#!/bin/sh
# Fails when a tracked C/CUDA source is not clang-formatted (.clang-format at the root).
cd "$1" || exit 1
command -v clang-format >/dev/null 2>&1 || { echo "clang-format not installed: skipped"; exit 77; }
files=$(git ls-files '*.c' '*.h' '*.cu' '*.cuh' 2>/dev/null)
[ -n "$files" ] || { echo "not a git checkout: skipped"; exit 77; }
clang-format --dry-run --Werror $files
