#!/bin/sh
# Extracts from the local mirror of SGLang (modal-projects/sglang, a bare git
# directory or a checkout) the part that tools/scripts/sglang_tests.py needs,
# into DEST (use peers/sglang: /peers/ is ignored by git, so the copy travels
# to the GPU host as an ignored path, within its 64 MiB limit):
#
#   python/sglang/**/*.py        every Python module except multimodal_gen/
#                                (the mamba tests' import chain reaches into
#                                most of srt/, kernels/ and jit_kernel/; the
#                                static closure is in sglang_tests.py --static)
#   python/sglang/srt/, kernels/ their data files too (JSON kernel configs)
#   python/pyproject.toml
#   test/registered/unit/mem_cache/, test/registered/unit/plugins/
#
#   python/sglang/jit_kernel/include/
#                                its headers (137 KB): jit_kernel/utils/compile.py
#                                resolves KERNEL_PATH at import and raises
#                                "Cannot find sglang.jit_kernel path" unless
#                                include/ and csrc/ both exist
#
# Not extracted: the rest of jit_kernel's C++/CUDA sources (the JIT needs
# tvm_ffi and a toolchain; csrc/ exists through its .py files), multimodal_gen,
# docs, benchmarks' data, sgl-kernel. Writes DEST/SNAPSHOT (commit, files, bytes).
#
# Usage: tools/scripts/sglang_snapshot.sh DEST
# Environment: SGLANG_MIRROR (default /work/.mirror/modal-projects+sglang/repo),
#              SGLANG_COMMIT (default the surveyed 8905cbd42f4a...).
set -eu

usage() {
    echo "usage: $0 DEST   (e.g. peers/sglang; SGLANG_MIRROR, SGLANG_COMMIT override the source)" >&2
    exit 2
}
[ $# -eq 1 ] || usage
case $1 in -h | --help) usage ;; esac
DEST=$1
MIRROR=${SGLANG_MIRROR:-/work/.mirror/modal-projects+sglang/repo}
COMMIT=${SGLANG_COMMIT:-8905cbd42f4a27dbecad6487cd3904278756fef8}

if [ -d "$MIRROR/.git" ]; then
    GIT_DIR=$MIRROR/.git
elif [ -f "$MIRROR/HEAD" ] && [ -d "$MIRROR/objects" ]; then
    GIT_DIR=$MIRROR
else
    echo "$0: $MIRROR is neither a git checkout nor a bare git directory (set SGLANG_MIRROR)" >&2
    exit 1
fi
if ! git --git-dir="$GIT_DIR" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
    echo "$0: commit $COMMIT is not in $GIT_DIR (set SGLANG_COMMIT)" >&2
    exit 1
fi
FULL=$(git --git-dir="$GIT_DIR" rev-parse "$COMMIT^{commit}")

if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ]; then
    if [ ! -f "$DEST/SNAPSHOT" ]; then
        echo "$0: $DEST exists, is not empty and holds no SNAPSHOT file: not overwriting it" >&2
        exit 1
    fi
    rm -rf "$DEST"
fi
mkdir -p "$DEST"

git --git-dir="$GIT_DIR" archive --format=tar "$FULL" -- \
    ':(glob)python/sglang/**/*.py' \
    ':(glob)python/sglang/srt/**' \
    ':(glob)python/sglang/kernels/**' \
    ':(exclude)python/sglang/multimodal_gen' \
    python/sglang/jit_kernel/include \
    python/pyproject.toml \
    test/registered/unit/mem_cache \
    test/registered/unit/plugins |
    tar -x -C "$DEST"

for need in python/sglang/srt/mem_cache/memory_pool.py python/sglang/srt/plugins/hook_registry.py \
    test/registered/unit/mem_cache/test_mamba_unittest.py; do
    if [ ! -f "$DEST/$need" ]; then
        echo "$0: $need is missing from the extracted tree" >&2
        exit 1
    fi
done
FILES=$(find "$DEST" -type f | wc -l | tr -d ' ')
BYTES=$(find "$DEST" -type f -exec cat {} + | wc -c | tr -d ' ')
{
    echo "source: $MIRROR"
    echo "commit: $FULL"
    echo "files: $FILES"
    echo "bytes: $BYTES"
} > "$DEST/SNAPSHOT"
cat "$DEST/SNAPSHOT"
echo "size: $(du -sh "$DEST" | cut -f1) on disk"
