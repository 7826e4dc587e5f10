#!/usr/bin/env python3
"""README's library example, exactly as printed, against the installed library.

Takes the ```c block of README.md that defines main(), installs the build
into a temporary DESTDIR (meson install), compiles the block against the
installed headers and shared library only (-Werror, C11, pedantic) and runs it
from the source root, where its default map path resolves. With --cuda the
block is compiled with -DEXAMPLE_CUDA and linked to cudart: the same program
on the CUDA backend (exit 77 without nvcc or without a device).
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile


def skip(why):
    print("SKIP: " + why)
    sys.exit(77)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--source", required=True, help="project source root")
    ap.add_argument("--build", required=True, help="meson build directory")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--cuda", action="store_true", help="compile for the CUDA backend")
    args = ap.parse_args()

    readme = open(os.path.join(args.source, "README.md"), encoding="utf-8").read()
    blocks = [b for b in re.findall(r"```c\n(.*?)```", readme, re.S) if re.search(r"\bint main\(", b)]
    if len(blocks) != 1:
        print(f"FAIL: README.md has {len(blocks)} ```c blocks with main(); expected exactly 1")
        return 1

    cuda_flags = []
    if args.cuda:
        nvcc = shutil.which("nvcc")
        if not nvcc:
            skip("nvcc is not on PATH")
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        libdirs = [d for d in (os.path.join(root, "lib64"), os.path.join(root, "targets", "x86_64-linux", "lib"))
                   if glob.glob(os.path.join(d, "libcudart.so*"))]
        if not libdirs:
            skip("libcudart not found next to nvcc")
        cuda_flags = ["-DEXAMPLE_CUDA", "-I" + os.path.join(root, "include"),
                      "-L" + libdirs[0], "-Wl,-rpath," + libdirs[0], "-lcudart"]

    with tempfile.TemporaryDirectory(prefix="stepq-readme-") as tmp:
        dest = os.path.join(tmp, "inst")
        r = subprocess.run(["meson", "install", "-C", args.build, "--destdir", dest,
                            "--no-rebuild", "--quiet"], capture_output=True, text=True)
        if r.returncode:
            print("FAIL: meson install:\n" + r.stdout + r.stderr)
            return 1
        headers = glob.glob(os.path.join(dest, "**", "include", "stepq", "stepq.h"), recursive=True)
        libs = glob.glob(os.path.join(dest, "**", "libstepq.so"), recursive=True)
        if len(headers) != 1 or len(libs) != 1:
            print(f"FAIL: installed tree has headers {headers} and libraries {libs}")
            return 1
        incdir = os.path.dirname(os.path.dirname(headers[0]))
        libdir = os.path.dirname(libs[0])
        src = os.path.join(tmp, "example.c")
        with open(src, "w", encoding="utf-8") as f:
            f.write(blocks[0])
        exe = os.path.join(tmp, "example")
        cmd = [args.cc, "-std=c11", "-pedantic", "-Wall", "-Wextra", "-Werror", "-O2", src,
               "-I" + incdir, "-L" + libdir, "-Wl,-rpath," + libdir, "-lstepq", "-lm", "-o", exe]
        cmd += cuda_flags
        print(" ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            print("FAIL: the README example does not compile:\n" + r.stdout + r.stderr)
            return 1
        r = subprocess.run([exe], cwd=args.source, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        if args.cuda and r.returncode and "ENODEV" in r.stderr:
            skip("no CUDA device")
        if r.returncode:
            print(f"FAIL: the README example exited {r.returncode}")
            return 1
    print("ok: the README example compiles against the installed library and passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
