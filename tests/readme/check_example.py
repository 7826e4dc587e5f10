#!/usr/bin/env python3
"""README's library example, exactly as printed, against the installed library.

Takes the ```c block of README.md that defines main(), installs the build
into a temporary DESTDIR (meson install), compiles the block against the
installed headers and shared library only (-Werror, C11, pedantic) and runs it
from the source root, where its default map path resolves. With --cuda the
block is compiled with -DEXAMPLE_CUDA and linked to cudart: the same program
on the CUDA backend (exit 77 without nvcc or without a device). With
--static the block is linked against the installed libstepq.a with the flags
of `pkg-config --static --libs stepq` and nothing else (host backend).
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


def install(build, dest):
    """meson install of the build into DESTDIR dest; (incdir, libdir) of the installed tree."""
    r = subprocess.run(["meson", "install", "-C", build, "--destdir", dest,
                        "--no-rebuild", "--quiet"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit("FAIL: meson install:\n" + r.stdout + r.stderr)
    headers = glob.glob(os.path.join(dest, "**", "include", "stepq", "stepq.h"), recursive=True)
    libs = glob.glob(os.path.join(dest, "**", "libstepq.so"), recursive=True)
    if len(headers) != 1 or len(libs) != 1:
        raise SystemExit(f"FAIL: installed tree has headers {headers} and libraries {libs}")
    return os.path.dirname(os.path.dirname(headers[0])), os.path.dirname(libs[0])


def static_flags(dest, libdir, cuda_root, sanitize):
    """The link of libstepq.a as `pkg-config --static` gives it, from the installed stepq.pc.

    A build without CUDA links fully static (-static: every library the
    archive needs must be in Libs.private); with CUDA, libstepq.a is linked
    statically and the CUDA runtime dynamically (the toolkit ships no
    libcudart.a), from its folder as README says, and so is a sanitizer
    build's (the sanitizer runtimes do not link fully static)."""
    pc = os.path.join(libdir, "pkgconfig")
    if not os.path.exists(os.path.join(pc, "stepq.pc")):
        raise SystemExit(f"FAIL: no stepq.pc in {pc}")
    if not shutil.which("pkg-config"):
        skip("pkg-config is not on PATH")
    # The installed .pc names the configured prefix; point it into DESTDIR.
    prefix = re.search(r"^prefix=(.*)$", open(os.path.join(pc, "stepq.pc")).read(), re.M).group(1)
    # Ahead of the caller's path, not instead of it: the Requires of stepq.pc
    # (libcjson, libuv) may live in a prefix that only PKG_CONFIG_PATH names.
    env = dict(os.environ, PKG_CONFIG_PATH=os.pathsep.join(
        [pc] + [d for d in os.environ.get("PKG_CONFIG_PATH", "").split(os.pathsep) if d]))
    r = subprocess.run(["pkg-config", "--define-variable=prefix=" + dest + prefix, "--cflags",
                        "--libs", "--static", "stepq"], capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit("FAIL: pkg-config --static stepq:\n" + r.stdout + r.stderr)
    flags = r.stdout.split()
    # A PKG_CONFIG_SYSROOT_DIR (dependencies staged under a sysroot) is put in front of every
    # -I/-L, stepq's DESTDIR paths too: take it off those, which are not under the sysroot.
    sysroot = os.environ.get("PKG_CONFIG_SYSROOT_DIR", "").rstrip("/")
    if sysroot:
        flags = [f[:2] + f[2 + len(sysroot):] if f[:2] in ("-I", "-L") and f[2:].startswith(sysroot + dest)
                 else f for f in flags]
    print("pkg-config --cflags --libs --static stepq: " + " ".join(flags))
    if ("-lcudart" in flags) != (cuda_root is not None):
        raise SystemExit("FAIL: stepq.pc %s -lcudart in a build %s CUDA"
                         % (("names", "without") if cuda_root is None else ("lacks", "with")))
    if cuda_root is None and not sanitize:
        # Fully static where every library named has an archive; otherwise (Debian ships
        # no libcjson.a) libstepq.a is linked statically and the others dynamically.
        def has_archive(lib):
            r = subprocess.run([os.environ.get("CC", "cc"), "-print-file-name=" + lib] +
                               [f for f in flags if f.startswith("-L")], capture_output=True, text=True)
            return os.path.isabs(r.stdout.strip())
        for lib in ("libc.a", "libm.a"):
            if not has_archive(lib):
                skip(f"no {lib} for a static link (install libc6-dev)")
        missing = [f[2:] for f in flags if f.startswith("-l") and f != "-lstepq"
                   and not has_archive("lib" + f[2:] + ".a") and f[2:] not in ("m", "pthread")]
        if not missing:
            return ["-static"] + flags
        print("no archive of %s: libstepq.a static, those dynamic" % ", ".join("lib" + m for m in missing))
    at = flags.index("-lstepq")  # the archive, not the shared library beside it
    flags[at:at + 1] = ["-Wl,-Bstatic", "-lstepq", "-Wl,-Bdynamic"]
    if cuda_root is None:
        return flags
    libdirs = [d for d in (os.path.join(cuda_root, "lib64"),
                           os.path.join(cuda_root, "targets", "x86_64-linux", "lib"))
               if glob.glob(os.path.join(d, "libcudart.so*"))]
    if not libdirs:
        skip("libcudart not found next to nvcc")
    return flags + ["-L" + libdirs[0], "-Wl,-rpath," + libdirs[0]]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--source", required=True, help="project source root")
    ap.add_argument("--build", required=True, help="meson build directory")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--cuda", action="store_true", help="compile for the CUDA backend")
    ap.add_argument("--static", choices=["host", "cuda"],
                    help="link libstepq.a through `pkg-config --static` (host backend), in a "
                         "build with or without CUDA; installs into BUILD/readme-static")
    ap.add_argument("--sanitize", default="none",
                    help="the build's b_sanitize: the program is compiled with it too")
    args = ap.parse_args()

    readme = open(os.path.join(args.source, "README.md"), encoding="utf-8").read()
    blocks = [b for b in re.findall(r"```c\n(.*?)```", readme, re.S) if re.search(r"\bint main\(", b)]
    if len(blocks) != 1:
        print(f"FAIL: README.md has {len(blocks)} ```c blocks with main(); expected exactly 1")
        return 1

    cuda_flags = []
    cuda_root = None
    if args.cuda or args.static == "cuda":
        nvcc = shutil.which("nvcc")
        if not nvcc:
            skip("nvcc is not on PATH")
        cuda_root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if args.cuda:
        libdirs = [d for d in (os.path.join(cuda_root, "lib64"), os.path.join(cuda_root, "targets", "x86_64-linux", "lib"))
                   if glob.glob(os.path.join(d, "libcudart.so*"))]
        if not libdirs:
            skip("libcudart not found next to nvcc")
        cuda_flags = ["-DEXAMPLE_CUDA", "-I" + os.path.join(cuda_root, "include"),
                      "-L" + libdirs[0], "-Wl,-rpath," + libdirs[0], "-lcudart"]

    with tempfile.TemporaryDirectory(prefix="stepq-readme-") as tmp:
        if args.static:
            dest = os.path.join(os.path.abspath(args.build), "readme-static")
            shutil.rmtree(dest, ignore_errors=True)
        else:
            dest = os.path.join(tmp, "inst")
        incdir, libdir = install(args.build, dest)
        src = os.path.join(tmp, "example.c")
        with open(src, "w", encoding="utf-8") as f:
            f.write(blocks[0])
        exe = os.path.join(tmp, "example")
        cmd = [args.cc, "-std=c11", "-pedantic", "-Wall", "-Wextra", "-Werror", "-O2", src]
        sanitize = args.sanitize not in ("", "none")
        if sanitize:  # an instrumented library needs the sanitizer runtimes
            cmd += ["-fsanitize=" + args.sanitize]
        if args.static:
            cmd += static_flags(dest, libdir, cuda_root, sanitize) + ["-o", exe]
        else:
            cmd += ["-I" + incdir, "-L" + libdir, "-Wl,-rpath," + libdir, "-lstepq", "-lm", "-o", exe]
            cmd += cuda_flags
        print(" ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            print("FAIL: the README example does not compile:\n" + r.stdout + r.stderr)
            return 1
        if args.static:
            r = subprocess.run(["ldd", exe], capture_output=True, text=True)
            if "libstepq" in r.stdout:
                print("FAIL: the static link still loads libstepq.so:\n" + r.stdout)
                return 1
        r = subprocess.run([exe], cwd=args.source, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        if args.cuda and r.returncode and "ENODEV" in r.stderr:
            skip("no CUDA device")
        if r.returncode:
            print(f"FAIL: the README example exited {r.returncode}")
            return 1
    how = "links statically (libstepq.a, pkg-config --static)" if args.static else "compiles"
    print(f"ok: the README example {how} against the installed library and passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
