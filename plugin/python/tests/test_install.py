"""The package as a user gets it: importing needs neither torch nor numpy
(nor a GPU), the library is found by STEPQ_LIBRARY and refused with a clear
ImportError when it is not there, `pip install --target DIR plugin/python`
gives a package that imports and works from DIR, and the example of
plugin/python/README.md runs as printed."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import _harness

import stepq


def _python(code, env_extra, cwd=None):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True)


def test_import_needs_neither_torch_nor_numpy():
    # numpy and torch made unimportable: the import and the slot lifecycle still work.
    code = ("import sys; sys.modules['numpy'] = None; sys.modules['torch'] = None\n"
            "import stepq\n"
            "m = stepq.load_map(%r)\n"
            "p = stepq.StatePool(m, size=2)\n"
            "ids = p.alloc(2); assert p.alloc(1) is None; p.free(ids); p.close()\n"
            "print('ok', stepq.library_version())\n"
            % _harness.data("config", "calibrated", "tiny-gdn", "stepq@6.json"))
    r = _python(code, {"PYTHONPATH": _harness.PACKAGE_ROOT})
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout


def test_a_missing_library_is_an_import_error_naming_stepq_library():
    r = _python("import stepq", {"PYTHONPATH": _harness.PACKAGE_ROOT,
                                 "STEPQ_LIBRARY": "/nonexistent/libstepq.so"})
    assert r.returncode != 0 and "ImportError" in r.stdout and "STEPQ_LIBRARY" in r.stdout, r.stdout


def test_the_loaded_library_is_the_one_stepq_library_names():
    want = os.environ.get("STEPQ_LIBRARY")
    if not want:
        _harness.skip("STEPQ_LIBRARY is not set (the system loader found the library)")
    assert stepq.library_path == want


def test_without_stepq_library_the_system_loader_finds_it():
    built = os.environ.get("STEPQ_LIBRARY")
    if not built:
        _harness.skip("STEPQ_LIBRARY is not set: no built library to point the loader at")
    env = {"PYTHONPATH": _harness.PACKAGE_ROOT, "STEPQ_LIBRARY": "",
           "LD_LIBRARY_PATH": os.path.dirname(os.path.abspath(built))}
    r = _python("import stepq; print(stepq.library_path, stepq.library_version())", env)
    assert r.returncode == 0 and r.stdout.split()[0] == "libstepq.so.%d.%d" % (
        stepq._lib.VERSION_MAJOR, stepq._lib.VERSION_MINOR), r.stdout


def test_pip_install_target_gives_an_importable_package():
    # Asked in child processes: importing pip or setuptools here would
    # load distutils into the test process.
    if _python("import pip", {}).returncode != 0:
        _harness.skip("pip is not installed for %s" % sys.executable)
    has_setuptools = _python("import setuptools", {}).returncode == 0
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "site")
        # A copy of the sources: pip's build writes build/ and *.egg-info beside them.
        src = os.path.join(tmp, "src")
        shutil.copytree(_harness.PACKAGE_ROOT, src,
                        ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
               "--disable-pip-version-check", "--no-cache-dir", "--target", target, src]
        if has_setuptools:
            # No registry at test time: build with the setuptools already installed.
            cmd.insert(4, "--no-build-isolation")
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           universal_newlines=True)
        assert r.returncode == 0, r.stdout
        assert os.path.exists(os.path.join(target, "stepq", "__init__.py"))
        assert not os.path.exists(os.path.join(target, "stepq", "tests"))  # the tests stay out
        code = ("import stepq, os\n"
                "assert os.path.dirname(stepq.__file__) == os.path.join(%r, 'stepq'), stepq.__file__\n"
                "m = stepq.load_map(%r); p = stepq.StatePool(m, size=1); print('ok', p.size)\n"
                % (target, _harness.data("config", "calibrated", "tiny-kda", "fp32.json")))
        r = _python(code, {"PYTHONPATH": target}, cwd=tmp)
        assert r.returncode == 0 and r.stdout.strip() == "ok 1", r.stdout


def test_the_readme_example_runs_as_printed():
    _harness.need_numpy()
    text = open(os.path.join(_harness.PACKAGE_ROOT, "README.md"), encoding="utf-8").read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "import stepq" in b]
    assert len(blocks) == 1, "plugin/python/README.md: %d python blocks import stepq" % len(blocks)
    r = _python(blocks[0], {"PYTHONPATH": _harness.PACKAGE_ROOT}, cwd=_harness.SOURCE_ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "STEPQ_EDOUBLEFREE", r.stdout


if __name__ == "__main__":
    sys.exit(_harness.main(dict(globals())))
