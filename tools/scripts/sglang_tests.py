#!/usr/bin/env python3
"""Runs SGLang's own mamba-pool unit tests with stepq's plugin in place, and
the same tests without it, so that a failure of the environment (a missing
package, a stubbed kernel) shows in both and a failure of stepq in one.

    tools/scripts/sglang_snapshot.sh peers/sglang          # once, from the mirror
    python3 tools/scripts/sglang_tests.py --sglang peers/sglang \\
        --library build-gpu/libstepq.so --json out/sglang-tests.json

The tests: test/registered/unit/mem_cache/test_mamba_unittest.py (the
mamba pool, MambaRadixCache, the host copies) and
test_unified_radix_cache_unittest.py (UnifiedRadixCache, which SGLang uses
for hybrid SSM models by default, with and without its mamba component) of
the snapshot; --test-file picks others, -k selects tests. Each run is its
own python3 process (a hook registry and a CUDA context per run):

  baseline         SGLang as it is.
  stepq            stepq's entry point (stepq.sglang:register, the value in
                   plugin/python/pyproject.toml) called with STEPQ_MAP set,
                   then HookRegistry.apply_hooks(), as SGLang's load_plugins
                   does; the tests never call load_plugins themselves.
  baseline-nospec, the same with HybridReqToTokenPool's
  stepq-nospec     speculative_num_draft_tokens forced to None: the tests
                   build their pools with speculative_num_draft_tokens=3,
                   which stepq refuses at start-up, so without this the
                   stepq run only shows that refusal. A MODIFIED setup,
                   reported as such.

The map (--map auto, the default): for each pool the tests build,
config/examples/qwen3-next-80b-a3b.uniform-4.json when its shape matches
(test_mamba_unittest's pools do: 36 layers of 32 heads 128x128), else a
uniform 8-bit map written for that pool's shape (the unified tests use
2 heads of 16x16); --map PATH uses one map for every pool.

Then (unless --no-kernel-check) a check that is not an SGLang test: stepq's
kernel backend (StepqLinearAttnKernel, decode and extend, GDN and KDA, on
the fp32 maps of config/calibrated/tiny-*) against SGLang's Triton kernels
on a dense pool, the conv views against SGLang's Triton conv update, and
the slot operations on the conv bytes.

Imports: SGLang's python/ directory goes first on sys.path.
SGLANG_IS_FLASHINFER_AVAILABLE=false is set (SGLang's switch: its
flashinfer imports are guarded by it). A module that cannot be imported is
stubbed only when the import chain needs it: sgl_kernel and flashinfer
always qualify; with --auto-stub (the default) any other missing module
that the chain imports is found by probing (a fresh process per probe) and
stubbed too, except torch, triton, numpy, sglang and stepq; so is a name
that an installed module lacks ("cannot import name X from M": M is
imported and X set on it as a stub, listed as M:X). The probe's
stub list is kept in the log directory (stubs.json) and reused by later
invocations on the same snapshot and Python (--reprobe probes again). A stub module
hands out stub classes for every attribute: they can be imported, named in
annotations and subclassed, and raise RuntimeError when called once the
tests start (calls while importing are recorded); msgspec, whose Struct
instances SGLang's kernel registry builds and reads at import time, gets a
dataclass-based Struct and field instead, orjson loads and dumps on the
json module, and dill pickle's dumps and loads (SHIMS). The report lists every
stub, the import that needed it and every call.

--static needs no torch: it walks SGLang's import statements from the test
module (abstract syntax trees, no import) and prints how far the chain
reaches and which third-party modules it imports unconditionally.

Output: a table per run (ran / passed / failed / errored / skipped, with the
reason), the comparison of stepq against baseline, and with --json the whole
report (JSON). Exit status: 0 when every requested run completed (whatever
the tests' outcomes), 1 when a run could not be completed, 2 for bad usage.
"""

import argparse
import ast
import copy
import dataclasses
import importlib
import importlib.abc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_FILES = ("test/registered/unit/mem_cache/test_mamba_unittest.py",
              "test/registered/unit/mem_cache/test_unified_radix_cache_unittest.py")
EXAMPLE_MAP = "config/examples/qwen3-next-80b-a3b.uniform-4.json"
KERNEL_MAPS = {"gdn": "config/calibrated/tiny-gdn/fp32.json",
               "kda": "config/calibrated/tiny-kda/fp32.json"}
RUNS = ("baseline", "stepq", "baseline-nospec", "stepq-nospec")
ALWAYS_STUB = ("sgl_kernel", "flashinfer")
NEVER_STUB = ("torch", "triton", "numpy", "sglang", "stepq")


# --- stubs -----------------------------------------------------------------

class _Stubs:
    strict = False       # calls raise once the tests start (except in a module body: _importing)
    served = {}          # module name -> the import that needed it
    calls = []           # calls while importing (name, where)
    reregistered = []    # transformers names SGLang registered again (name, where)
    maps = {}            # --map auto: map path -> pools built on it


def _caller():
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename
        if "importlib" in f or f == __file__ or f.startswith("<frozen"):
            continue
        return "%s:%d" % (f, frame.lineno)
    return "?"


def _importing():
    """True while an import is executing a module body somewhere up the stack (a `<module>` frame
    that importlib's loader called): a stub called there is import-time use (a pydantic Field in a class body, a decorator), which
    is the environment's, recorded rather than raised even once the tests have started (a check
    may import SGLang modules lazily, as stepq's plugin builds its classes on first use)."""
    f = sys._getframe(1)
    while f is not None:
        if (f.f_code.co_name == "<module>" and f.f_back is not None
                and f.f_back.f_code.co_filename.startswith("<frozen importlib")):
            return True
        f = f.f_back
    return False


class _StubMeta(type):
    def __new__(mcs, name, bases, ns, **kwargs):
        return super().__new__(mcs, name, bases, ns)

    def __init__(cls, name, bases, ns, **kwargs):
        super().__init__(name, bases, ns)

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class("%s.%s" % (cls._stub_name, name))

    def __getitem__(cls, item):
        return cls

    def __call__(cls, *args, **kwargs):
        if not cls.__dict__.get("_stub_generated"):
            return super().__call__(*args, **kwargs)  # a real class deriving from a stub
        if _Stubs.strict and not _importing():
            raise RuntimeError("%s called: it is a stub (sglang_tests.py), the module is not "
                               "installed here" % cls._stub_name)
        _Stubs.calls.append((cls._stub_name, _caller()))
        return _stub_class(cls._stub_name + "()")


class _StubBase(metaclass=_StubMeta):
    _stub_name = "stub"

    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass


def _stub_class(name):
    return _StubMeta(name.rsplit(".", 1)[-1], (_StubBase,),
                     {"_stub_name": name, "_stub_generated": True})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            if name == "__version__":
                return "0.0.0"
            raise AttributeError(name)
        return _stub_class("%s.%s" % (self.__name__, name))


def _msgspec_shim(name):
    """msgspec when it is not installed: SGLang's kernel registry builds msgspec.Struct
    instances at import time (sglang/kernels/spec.py: KernelSpec, CapabilityRequirement),
    which a stub class cannot hold (they read the fields back). Struct here is a dataclass
    base (its class keywords frozen, kw_only, order and eq kept, the rest ignored) and field
    maps to dataclasses.field; every other attribute is a stub as in _StubModule. It builds
    and compares structs; it does not encode them (msgspec.msgpack / json stay stubs)."""
    m = _StubModule(name)
    nodefault = type("NODEFAULT", (), {"__repr__": lambda self: "NODEFAULT"})()

    def field(*, default=nodefault, default_factory=nodefault, name=None):
        kw = {}
        if default is not nodefault:
            kw["default"] = default
        if default_factory is not nodefault:
            kw["default_factory"] = default_factory
        return dataclasses.field(**kw)

    class Struct:
        def __init_subclass__(cls, frozen=False, kw_only=False, order=False, eq=True, **_ignored):
            super().__init_subclass__()
            ann = cls.__dict__.get("__annotations__", {})
            for k, v in list(cls.__dict__.items()):  # msgspec copies a mutable default per instance
                if k in ann and isinstance(v, (list, dict, set)):
                    setattr(cls, k, dataclasses.field(default_factory=lambda v=v: copy.copy(v)))
            opts = {"kw_only": True} if kw_only else {}
            dataclasses.dataclass(frozen=frozen, order=order, eq=eq, **opts)(cls)

    m.Struct, m.field, m.NODEFAULT = Struct, field, nodefault
    return m


def _orjson_shim(name):
    """orjson when it is not installed (sglang/srt/utils/common.py imports it at the top):
    loads, dumps (bytes, as orjson's) and the OPT_* flags on the standard json module, so
    that a code path that does parse or write JSON gets the same values; other attributes
    are stubs."""
    m = _StubModule(name)

    def dumps(obj, default=None, option=None):
        return json.dumps(obj, default=default, sort_keys=bool((option or 0) & m.OPT_SORT_KEYS),
                          indent=2 if (option or 0) & m.OPT_INDENT_2 else None).encode()

    def loads(data):
        return json.loads(data)

    m.dumps, m.loads, m.JSONDecodeError, m.JSONEncodeError = dumps, loads, json.JSONDecodeError, TypeError
    for i, opt in enumerate(("OPT_APPEND_NEWLINE", "OPT_INDENT_2", "OPT_NAIVE_UTC", "OPT_NON_STR_KEYS",
                             "OPT_OMIT_MICROSECONDS", "OPT_PASSTHROUGH_DATACLASS",
                             "OPT_PASSTHROUGH_DATETIME", "OPT_PASSTHROUGH_SUBCLASS",
                             "OPT_SERIALIZE_NUMPY", "OPT_SORT_KEYS", "OPT_STRICT_INTEGER", "OPT_UTC_Z")):
        setattr(m, opt, 1 << i)
    return m


def _dill_shim(name):
    """dill when it is not installed: SGLang serialises a logit processor class at import
    time (sglang/srt/sampling/custom_logit_processor.py: json.dumps({"callable":
    dill.dumps(cls).hex()})), which a stub's return value cannot go through. dumps and loads
    are pickle's (the same bytes for a class importable by name, which is what it pickles);
    other attributes are stubs."""
    import pickle

    m = _StubModule(name)
    m.dumps, m.loads, m.dump, m.load = pickle.dumps, pickle.loads, pickle.dump, pickle.load
    return m


# Stubbed modules that need working stand-ins for the names SGLang uses at import time.
SHIMS = {"msgspec": _msgspec_shim, "orjson": _orjson_shim, "dill": _dill_shim}


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Appended to sys.meta_path: consulted only for modules nothing else finds."""

    def __init__(self, names):
        self.names = tuple(names)

    def _covers(self, fullname):
        return any(fullname == n or fullname.startswith(n + ".") for n in self.names)

    def find_spec(self, fullname, path=None, target=None):
        if not self._covers(fullname):
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        m = SHIMS[spec.name](spec.name) if spec.name in SHIMS else _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        _Stubs.served.setdefault(module.__name__, _caller())


def _stub_finder():
    """The _StubFinder on sys.meta_path, or None. Not sys.meta_path[-1]: an import after
    _install_stubs (transformers, in _tolerate_reregistration) may append a finder of its own."""
    return next((f for f in sys.meta_path if isinstance(f, _StubFinder)), None)


def _install_stubs(names):
    """names: modules to stub, and MODULE:NAME entries, a name that an installed module lacks
    (an SGLang snapshot importing a name its transformers no longer or not yet has): the
    module is imported for real and the name set on it as a stub class (_stub_name_in)."""
    mods = [n for n in names if ":" not in n]
    if mods:
        sys.meta_path.append(_StubFinder(mods))
    for n in names:
        if ":" in n:
            _stub_name_in(*n.split(":", 1))


def _stub_name_in(module, name):
    """Sets a stub class as module.name when the (real) module lacks it; recorded as served."""
    m = importlib.import_module(module)
    if not hasattr(m, name):
        setattr(m, name, _stub_class("%s.%s" % (module, name)))
        _Stubs.served.setdefault("%s:%s" % (module, name), _caller())


_NAME_RE = re.compile(r"cannot import name '([^']+)' from '([^']+)'")


def _in_chain(exc, pick):
    """The first exception of exc's chain (causes, contexts) for which pick gives a name:
    (that name, where: the innermost frame outside importlib), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = pick(exc)
        if name:
            where = "?"
            for fr in reversed(traceback.extract_tb(exc.__traceback__)):
                if "importlib" not in fr.filename and not fr.filename.startswith("<frozen"):
                    where = "%s:%d" % (fr.filename, fr.lineno)
                    break
            return name, where
        exc = exc.__cause__ or exc.__context__
    return None


def _missing_name(exc):
    """The "cannot import name X from M" ImportError in an exception's chain: (M:X, where)."""
    def pick(e):
        if isinstance(e, ImportError) and not isinstance(e, ModuleNotFoundError):
            g = _NAME_RE.search(str(e))
            return "%s:%s" % (g.group(2), g.group(1)) if g else None
        return None
    return _in_chain(exc, pick)


def _missing_module(exc):
    """The ModuleNotFoundError in an exception's chain: (name, where)."""
    return _in_chain(exc, lambda e: e.name if isinstance(e, ModuleNotFoundError) else None)


# --- the child processes ---------------------------------------------------

def _load_test_module(sglang_dir, rel):
    path = os.path.join(sglang_dir, rel)
    name = os.path.splitext(os.path.basename(rel))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return mod


def _tolerate_reregistration():
    """SGLang registers its own configs and processors with transformers at import time
    (sglang/srt/configs: AutoConfig.register("qwen3_asr", ...), AutoProcessor.register, ...).
    A transformers newer than the snapshot ships some of those names itself and refuses a
    second registration (ValueError: "'qwen3_asr' is already used by a Transformers config"),
    which stops the import of everything under sglang.srt.configs. Here a second registration
    replaces the first, as exist_ok=True does (SGLang's class wins, as SGLang intends), and each
    one is recorded for the report. None of them is a class the mamba-pool tests use."""
    try:
        from transformers.models.auto import auto_factory, configuration_auto
    except ImportError:
        return
    for cls in (configuration_auto._LazyConfigMapping, auto_factory._LazyAutoMapping):
        orig = cls.register
        if getattr(orig, "_stepq_tolerant", False):
            continue

        def register(self, key, value, exist_ok=False, _orig=orig):
            try:
                return _orig(self, key, value, exist_ok=exist_ok)
            except ValueError:
                if exist_ok:
                    raise
                _Stubs.reregistered.append((getattr(key, "__name__", str(key)), _caller()))
                return _orig(self, key, value, exist_ok=True)

        register._stepq_tolerant = True
        cls.register = register


def _child_setup(args):
    sys.path.insert(0, os.path.join(os.path.abspath(args.sglang), "python"))
    _install_stubs(args.stub)
    _tolerate_reregistration()


# SGLang's test_utils.retry re-raises every test error as "retry() exceed maximum number of retries." or
# "retry() observe errors that should not be retried."
RETRY_WRAPPER = "retry() "


def _exc_summary(exc_info):
    etype, value, tb = exc_info
    via = None
    # SGLang's CustomTestCase runs each test method through srt/utils/common.py's retry(), which
    # replaces the test's exception by a bare Exception("retry() exceed maximum number of
    # retries.") raised inside its handler: the test's own error is that one's __context__.
    if str(value).startswith(RETRY_WRAPPER) and value.__context__ is not None:
        via = "SGLang's retry() wrapper"
        value = value.__context__
        etype, tb = type(value), value.__traceback__
    frames = traceback.extract_tb(tb)
    where = ["%s:%d %s" % (os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT)
                           else f.filename, f.lineno, f.name) for f in frames[-4:]]
    text = str(value).strip().splitlines()
    out = {"type": etype.__name__, "message": " ".join(text)[:1500], "where": where}
    if via:
        out["via"] = via
    return out


HOOK_MODULES = ("sglang.srt.layers.attention.linear.gdn_backend",
                "sglang.srt.layers.attention.linear.kda_backend",
                "sglang.srt.mem_cache.memory_pool_host")


def _child_probe(args):
    """Imports the test modules (or the hook modules), adding a stub and
    retrying in this process for each missing module (or missing name of a
    module, M:X) it may stub."""
    _child_setup(args)
    finder = _stub_finder()
    out = {"ok": False, "added": []}
    for _ in range(60):
        try:
            if args.run == "hooks":
                for name in HOOK_MODULES:
                    importlib.import_module(name)
            else:
                for rel in args.test_file:
                    _load_test_module(args.sglang, rel)
            out["ok"] = True
            break
        except BaseException as e:  # noqa: B902 - report whatever stops the import
            out["error"] = _exc_summary(sys.exc_info())
            out.pop("missing", None)
            miss = _missing_module(e)
            name = None if miss else _missing_name(e)  # a module, else a name (M:X) of a module
            hit = miss or name
            if not hit:
                break
            out["missing"], out["where"] = hit
            if not args.auto_stub or hit[0].split(":")[0].split(".")[0] in NEVER_STUB:
                break
            if name:
                if name[0] in [a for a, _ in out["added"]]:
                    break  # stubbed already and still missing
                _stub_name_in(*name[0].split(":", 1))
            else:
                if finder is None:  # no stub asked for yet: the first one installs the finder
                    finder = _StubFinder(())
                    sys.meta_path.append(finder)
                elif finder._covers(miss[0]):
                    break
                finder.names += (miss[0],)
            out["added"].append(hit)
    out["served"] = dict(_Stubs.served)
    return out


def _apply_stepq():
    """What SGLang's load_plugins() does for one entry point: resolve it, call
    it, apply the hooks."""
    import pkgutil

    info = {}
    try:
        from importlib.metadata import entry_points

        eps = entry_points(group="sglang.srt.plugins")
        info["installed_entry_points"] = ["%s = %s" % (ep.name, ep.value) for ep in eps]
    except Exception as e:  # the metadata API differs across Pythons
        info["installed_entry_points"] = "unknown (%s)" % e
    from stepq import sglang as plugin

    func = pkgutil.resolve_name(plugin.ENTRY_POINT)
    info["registered"] = func()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    info["patched"] = sorted(HookRegistry._patched)
    missing = [t for t in info["registered"] if t not in HookRegistry._patched]
    if missing:
        raise RuntimeError("stepq's hooks were not applied: %s (SGLang logged why)" % missing)
    return info


def _auto_maps(tmpdir):
    """--map auto: before each StepqMambaPool is built, STEPQ_MAP names the
    example map when its shape matches the pool's, else a uniform 8-bit map
    written for that shape (a test harness choice, reported as such)."""
    import stepq
    from stepq import sglang as plugin

    c = plugin._classes()
    orig = c.StepqMambaPool.__init__
    made = {}
    example = os.path.join(ROOT, EXAMPLE_MAP)
    ex_desc = plugin.map_desc(stepq.load_map(example))

    def init(self, **kw):
        cd = plugin.cache_desc(kw["cache_params"], kw["mamba_layer_ids"])
        try:
            plugin.check_map(ex_desc, cd)
            path = example
        except plugin.Unsupported:
            key = json.dumps(cd, sort_keys=True, default=str)
            path = made.get(key)
            if path is None:
                path = os.path.join(tmpdir, "map-%d.json" % len(made))
                with open(path, "w") as f:
                    json.dump(_uniform_map(cd), f)
                made[key] = path
        os.environ[plugin.MAP_ENV] = path
        _Stubs.maps[path] = _Stubs.maps.get(path, 0) + 1
        return orig(self, **kw)

    c.StepqMambaPool.__init__ = init


def _uniform_map(cd):
    hv, v, k = cd["temporal"]
    h = cd["num_k_heads_per_tp"] or hv
    head = {"row_bits": [8] * k} if cd["is_kda"] else {"bits": 8}
    return {"format": "stepq-precision-map", "schema_version": 1,
            "model": {"name": "sglang-unit-test-shape", "arch": "kda" if cd["is_kda"] else "gdn",
                      "recurrent_layers": list(cd["layer_ids"]), "num_k_heads": h,
                      "num_v_heads": hv, "head_k_dim": k, "head_v_dim": v,
                      "conv_state": {"shape": list(cd["conv"][0]), "dtype": cd["conv_dtype"]}},
            "method": "uniform", "budget_bits": 8,
            "provenance": {"tool": "tools/scripts/sglang_tests.py",
                           "notes": "written for an SGLang unit test's pool shape"},
            "layers": [{"layer": l, "pivots": [], "heads": [dict(head) for _ in range(hv)]}
                       for l in cd["layer_ids"]]}


def _force_no_spec():
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    orig = HybridReqToTokenPool.__init__

    def init(self, *a, **kw):
        kw["speculative_num_draft_tokens"] = None
        return orig(self, *a, **kw)

    HybridReqToTokenPool.__init__ = init


def _result_class():
    """A unittest result that records one row per test."""
    import unittest

    class Result(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.rows, self._t0 = [], time.time()

        def _add(self, test, outcome, err=None, reason=None):
            # module.Class.method: the class is part of the name, as SGLang's unified radix
            # tests generate one TestCase class per cache configuration with the same methods.
            tid = test.id().split(" ", 1)
            parts = tid[0].split(".")
            name = ".".join([parts[0].replace("test_", "", 1)[:24]] + parts[-2:])
            if len(tid) > 1:
                name += " " + tid[1]  # a subtest: its parameters
            row = {"test": name, "outcome": outcome}
            if err is not None:
                row.update(_exc_summary(err))
            if reason is not None:
                row["message"] = str(reason)
            row["seconds"] = round(time.time() - self._t0, 3)
            self.rows.append(row)

        def startTest(self, test):
            super().startTest(test)
            self._t0 = time.time()
            print("=== %s" % test.id(), flush=True)

        def addSuccess(self, test):
            self._add(test, "passed")

        def addFailure(self, test, err):
            self._add(test, "failed", err)

        def addError(self, test, err):
            self._add(test, "errored", err)

        def addSkip(self, test, reason):
            self._add(test, "skipped", reason=reason)

        def addExpectedFailure(self, test, err):
            self._add(test, "passed", reason="expected failure")

        def addSubTest(self, test, subtest, err):
            # A failing subtest is its own row (the test method then reports no success).
            super().addSubTest(test, subtest, err)
            if err is not None:
                failed = issubclass(err[0], test.failureException)
                self._add(subtest, "failed" if failed else "errored", err)

        def addUnexpectedSuccess(self, test):
            self._add(test, "failed", reason="unexpected success")

    return Result


def _child_run(args):
    import unittest

    _child_setup(args)
    out = {"run": args.run, "tests": []}
    try:
        if args.run.startswith("stepq"):
            out["stepq"] = _apply_stepq()
            if args.map == "auto":
                _auto_maps(tempfile.mkdtemp(prefix="stepq-maps-"))
        if args.run.endswith("-nospec"):
            _force_no_spec()
            out["modified"] = "HybridReqToTokenPool(speculative_num_draft_tokens=None) forced"
        mods = [_load_test_module(args.sglang, rel) for rel in args.test_file]
    except BaseException:  # noqa: B902
        out["setup_error"] = _exc_summary(sys.exc_info())
        out["served"], out["import_calls"] = dict(_Stubs.served), list(_Stubs.calls)
        out["reregistered"] = list(_Stubs.reregistered)
        return out
    out["served"], out["import_calls"] = dict(_Stubs.served), list(_Stubs.calls)
    out["reregistered"] = list(_Stubs.reregistered)
    _Stubs.strict = True
    loader = unittest.TestLoader()
    tests = [t for m in mods for t in _iter_suite(loader.loadTestsFromModule(m))
             if not args.k or any(k in t.id() for k in args.k)]
    result = _result_class()()
    unittest.TestSuite(tests).run(result)
    out["tests"] = result.rows
    if _Stubs.maps:
        out["maps"] = dict(_Stubs.maps)
    if args.run.startswith("stepq"):
        try:
            from stepq import sglang as plugin

            out["hook_status"] = dict(plugin.hook_status)
        except Exception:
            pass
    return out


def _iter_suite(suite):
    for t in suite:
        if hasattr(t, "__iter__"):
            yield from _iter_suite(t)
        else:
            yield t


# --- the kernel check (stepq's backend against SGLang's Triton kernels) -----

def _child_kernels(args):
    _child_setup(args)
    out = {"checks": []}

    def record(name, fn):
        t0 = time.time()
        print("--- %s ..." % name, flush=True)  # progress in the child's log (Triton compiles and
        try:                                     # autotunes SGLang's kernels on first use: minutes)
            detail = fn()
            out["checks"].append({"check": name, "outcome": "passed", "detail": detail,
                                  "seconds": round(time.time() - t0, 3)})
        except BaseException:  # noqa: B902
            row = {"check": name, "outcome": "failed", "seconds": round(time.time() - t0, 3)}
            row.update(_exc_summary(sys.exc_info()))
            out["checks"].append(row)
        print("    %s in %.1f s" % (out["checks"][-1]["outcome"], time.time() - t0), flush=True)
        with open(args.result, "w") as f:  # what ran so far survives a --timeout kill
            json.dump(dict(out, partial=True), f, indent=1, default=str)

    try:
        import torch
        from sglang.srt.configs.mamba_utils import (KimiLinearCacheParams, KimiLinearStateShape,
                                                    Mamba2CacheParams, Mamba2StateDType,
                                                    Mamba2StateShape)

        from stepq import sglang as plugin
    except BaseException:  # noqa: B902
        out["setup_error"] = _exc_summary(sys.exc_info())
        out["served"] = dict(_Stubs.served)
        return out
    out["served"] = dict(_Stubs.served)
    _Stubs.strict = True
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(dtype)

    def rel(a, b):
        a, b = a.float(), b.float()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    for arch in ("gdn", "kda"):
        os.environ[plugin.MAP_ENV] = os.path.join(ROOT, KERNEL_MAPS[arch])
        layers = [0, 1, 2, 4, 5, 6]
        H, HV, K, V = (4, 8, 128, 128) if arch == "gdn" else (8, 8, 128, 128)
        dtypes = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
        if arch == "gdn":
            cp = Mamba2CacheParams(shape=Mamba2StateShape.create(
                tp_world_size=1, intermediate_size=HV * V, n_groups=H, num_heads=HV, head_dim=V,
                state_size=K, conv_kernel=4), layers=layers, dtype=dtypes)
        else:
            cp = KimiLinearCacheParams(shape=KimiLinearStateShape.create(
                tp_world_size=1, num_heads=HV, head_dim=V, num_k_heads=H, head_k_dim=K,
                conv_kernel_size=4), layers=layers, dtype=dtypes)
        state = {}

        def build():
            c = plugin._classes()
            pool = c.StepqMambaPool(size=8, spec_state_size=8, cache_params=cp,
                                    mamba_layer_ids=layers, device="cuda")
            alloc = c.StepqSlotAllocator(pool)
            ids = alloc.alloc(3)
            state.update(pool=pool, alloc=alloc, ids=ids, ids32=ids.to(torch.int32), c=c)
            conv = pool.mamba_cache.conv[0]
            expect = (len(layers), 9) + tuple(cp.shape.conv[0])
            if tuple(conv.shape) != expect:
                raise AssertionError("conv view %s, expected %s" % (tuple(conv.shape), expect))
            return {"conv_shape": list(conv.shape), "conv_stride": list(conv.stride()),
                    "page_bytes": pool.statepool.page_bytes, "ids": ids.tolist()}

        record("%s: StepqMambaPool + StepqSlotAllocator" % arch, build)
        if "pool" not in state:
            continue
        pool, ids, ids32, c = state["pool"], state["ids"], state["ids32"], state["c"]
        sp = pool.statepool

        def slots():
            conv = pool.mamba_cache.conv[0]
            conv[:, ids] = rnd(len(layers), 3, *cp.shape.conv[0], dtype=torch.bfloat16)
            dst = state["alloc"].alloc(1)
            pool.copy_from(ids[:1], dst)
            if not torch.equal(conv[:, dst[0]], conv[:, ids[0]]):
                raise AssertionError("copy_from did not copy the conv bytes")
            saved = pool.get_cpu_copy(dst)
            pool.clear_slots(dst)
            if conv[:, dst[0]].abs().max().item() != 0:
                raise AssertionError("clear_slots left conv bytes")
            pool.load_cpu_copy(saved, dst)
            if not torch.equal(conv[:, dst[0]], conv[:, ids[0]]):
                raise AssertionError("load_cpu_copy did not restore the conv bytes")
            state["alloc"].free(dst)
            return {"host_copy": list(saved.shape)}

        record("%s: copy_from / clear_slots / get_cpu_copy / load_cpu_copy on the conv view"
               % arch, slots)

        def conv_update():
            from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

            view = pool.mamba_cache.conv[0][1]             # layer 1: [9, *conv]
            if arch == "kda":
                view = view.transpose(-1, -2)                # the backend's [9, dim, K-1]
            dense = view.clone()
            dim = view.shape[-2]
            x = rnd(3, dim, dtype=torch.bfloat16)
            w = rnd(dim, 4, dtype=torch.bfloat16, scale=0.5)
            y_s = causal_conv1d_update(x.clone(), view, w, None, "silu", conv_state_indices=ids32)
            y_d = causal_conv1d_update(x.clone(), dense, w, None, "silu", conv_state_indices=ids32)
            if not (torch.equal(y_s, y_d) and torch.equal(view, dense)):
                raise AssertionError("causal_conv1d_update on the stepq view differs: out %g, "
                                     "state %g" % (rel(y_s, y_d), rel(view, dense)))
            return "identical"

        record("%s: causal_conv1d_update (Triton) on the strided conv view" % arch, conv_update)

        if arch == "gdn":
            from sglang.srt.layers.attention.linear.kernels.gdn_triton import \
                TritonGDNKernel as Dense
        else:
            from sglang.srt.layers.attention.linear.kernels.kda_triton import \
                TritonKDAKernel as Dense
        dense_kernel = Dense()
        kernel = c.StepqLinearAttnKernel(pool, dense_kernel)
        S0 = rnd(3, HV, V, K, scale=0.05)
        A_log = rnd(HV, scale=0.5)
        if arch == "gdn":
            dt_bias = rnd(HV, dtype=torch.bfloat16)          # Qwen3-Next: bf16 next to fp32 A_log
            A_arg = A_log
        else:
            dt_bias = rnd(HV * K)                            # Kimi-Linear: flat fp32
            A_arg = A_log.view(1, 1, HV, 1)

        def fresh(layer):
            ref = torch.zeros(9, HV, V, K, device=dev)
            ref[ids] = S0
            sp.pack(layer, ids32, S0.clone(), layout="vk")
            return ref, pool.mamba2_layer_cache(layer).temporal

        def inputs(*xs):
            return [x.clone() for x in xs]

        def decode():
            ref, st = fresh(0)
            B = 3
            q, k = rnd(1, B, H, K, dtype=torch.bfloat16), rnd(1, B, H, K, dtype=torch.bfloat16)
            v = rnd(1, B, HV, V, dtype=torch.bfloat16)
            if arch == "gdn":
                a, b = rnd(B, HV, dtype=torch.bfloat16), rnd(B, HV, dtype=torch.bfloat16)
            else:
                a, b = rnd(B, HV * K, dtype=torch.bfloat16), rnd(1, B, HV, dtype=torch.bfloat16)
            qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
            # Each kernel gets its own copies of the inputs and its output is copied at once:
            # SGLang's kernels may write into their inputs (KDA's chunk kernel writes o into v).
            o_ref = dense_kernel.decode(*inputs(q, k, v, a, b), A_log=A_arg, dt_bias=dt_bias,
                                        ssm_states=ref, cache_indices=ids32, query_start_loc=qsl).clone()
            o = kernel.decode(*inputs(q, k, v, a, b), A_log=A_arg, dt_bias=dt_bias, ssm_states=st,
                              cache_indices=ids32, query_start_loc=qsl)
            S = sp.unpack(0, ids32, layout="vk")
            d = {"out_shape": list(o.shape), "out_rel": rel(o, o_ref), "state_rel": rel(S, ref[ids])}
            if tuple(o.shape) != tuple(o_ref.shape) or d["out_rel"] > 2e-2 or d["state_rel"] > 1e-3:
                raise AssertionError("decode differs from SGLang's Triton kernel: %s" % d)
            return d

        record("%s: StepqLinearAttnKernel.decode vs %s.decode (fp32 map)"
               % (arch, Dense.__name__), decode)

        def extend(gather):
            layer = 2 if gather else 1
            ref, st = fresh(layer)
            lens = [5, 70]
            T = sum(lens)
            qsl = torch.tensor([0, 5, 75], dtype=torch.int32, device=dev)
            q, k = rnd(1, T, H, K, dtype=torch.bfloat16), rnd(1, T, H, K, dtype=torch.bfloat16)
            v = rnd(1, T, HV, V, dtype=torch.bfloat16)
            kw = {}
            if arch == "gdn":
                from sglang.kernels.ops.attention.fla.fused_gdn_gating import fused_gdn_gating

                a, b = rnd(T, HV, dtype=torch.bfloat16), rnd(T, HV, dtype=torch.bfloat16)
                g, beta = fused_gdn_gating(A_log, a, b, dt_bias)
            else:
                g = rnd(1, T, HV, K, dtype=torch.bfloat16)
                beta = rnd(1, T, HV).sigmoid()
                kw = {"A_log": A_arg, "dt_bias": dt_bias, "lower_bound": None}
            r_ref = dense_kernel.extend(*inputs(q, k, v, g, beta), ssm_states=ref, cache_indices=ids32[:2],
                                        query_start_loc=qsl, **kw)
            o_ref = (r_ref[0] if isinstance(r_ref, tuple) else r_ref).clone()
            sel = ids32[:2]
            if gather:
                g_st = st[sel].contiguous()
                r = kernel.extend(*inputs(q, k, v, g, beta), ssm_states=g_st,
                                  cache_indices=torch.arange(2, dtype=torch.int32, device=dev),
                                  query_start_loc=qsl, **kw)
                st[sel] = g_st  # the backend's scatter back: a no-op once packed
            else:
                r = kernel.extend(*inputs(q, k, v, g, beta), ssm_states=st, cache_indices=sel,
                                  query_start_loc=qsl, **kw)
            o = r[0] if isinstance(r, tuple) else r
            S = sp.unpack(layer, sel, layout="vk")
            d = {"out_rel": rel(o, o_ref), "state_rel": rel(S, ref[sel.long()]),
                 "returned": type(r).__name__}
            if d["out_rel"] > 1e-5 or d["state_rel"] > 1e-5:
                raise AssertionError("extend differs from SGLang's Triton kernel: %s" % d)
            return d

        record("%s: StepqLinearAttnKernel.extend vs %s.extend (fp32 map)"
               % (arch, Dense.__name__), lambda: extend(False))
        if arch == "gdn":
            record("gdn: extend through the gather path (GDNAttnBackend's needs_state_gather)",
                   lambda: extend(True))

        def refusals():
            seen = []
            st = pool.mamba2_layer_cache(0).temporal
            for what, fn in (("temporal[:, ids] read", lambda: pool.mamba_cache.temporal[:, ids]),
                             ("temporal[l][ids] = x", lambda: st.__setitem__(ids, 0.0)),
                             ("torch.zeros_like(temporal[l])", lambda: torch.zeros_like(st)),
                             ("target_verify", lambda: kernel.target_verify())):
                try:
                    fn()
                except plugin.Unsupported as e:
                    seen.append("%s: %s" % (what, e.name))
                    continue
                raise AssertionError("%s was not refused" % what)
            return seen

        record("%s: PackedStates and target_verify refuse" % arch, refusals)

        def sizing():
            """SGLang's own KVCacheConfigurator._handle_max_mamba_cache (its auto-sizing branch),
            called on a stand-in configurator, without and with stepq's sizing hook: the slot count
            follows stepq's page + health word instead of the dense slot, and the memory left to
            the KV cache is what the stepq slots do not take."""
            from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

            fn = KVCacheConfigurator._handle_max_mamba_cache

            class Args:
                max_mamba_cache_size = None
                disable_radix_cache = False
                max_running_requests = None
                speculative_num_draft_tokens = None
                mamba_full_memory_ratio = 0.9

                def override(self, _why, **kw):
                    for k, v in kw.items():
                        setattr(self, k, v)

            class Conf:
                def __init__(self):
                    self.mambaish_config = types.SimpleNamespace(mamba2_cache_params=cp)
                    self.server_args = Args()
                    self.spec_algorithm = types.SimpleNamespace(is_none=lambda: True)
                    self.ps = types.SimpleNamespace(attn_dp_size=1, attn_tp_rank=0, attn_tp_size=1)
                    self.layer_info = types.SimpleNamespace(start_layer=0, end_layer=max(layers) + 1)
                    self.device = "cuda"

            total = 40.0
            dense, hooked = Conf(), Conf()
            rest_dense = fn(dense, total)
            rest = plugin._mamba_sizing_around(fn, hooked, total)
            per = sp.page_bytes + plugin.HEALTH_WORD_BYTES
            budget = total * 0.9 / 1.9 * (1 << 30)
            n, n_dense = hooked.server_args.max_mamba_cache_size, dense.server_args.max_mamba_cache_size
            if n_dense != int(budget // cp.mamba_cache_per_req):
                raise AssertionError("dense sizing %d slots, expected %d" % (n_dense, int(budget // cp.mamba_cache_per_req)))
            if n != int(budget // per):
                raise AssertionError("hooked sizing %d slots, expected %d (stepq slot %d B)" % (n, int(budget // per), per))
            if abs((total - rest) - n * per / (1 << 30)) > 1e-6 or hooked.mambaish_config.mamba2_cache_params is not cp:
                raise AssertionError("rest %r for %d slots of %d B, or the configurator was not restored" % (rest, n, per))
            return {"dense_slot_bytes": cp.mamba_cache_per_req, "stepq_slot_bytes": per, "slots_dense": n_dense,
                    "slots_stepq": n, "rest_gb_dense": round(rest_dense, 4), "rest_gb_stepq": round(rest, 4)}

        record("%s: SGLang's _handle_max_mamba_cache sizes by stepq's slot (the sizing hook)" % arch, sizing)
        state["alloc"].free(ids)
        pool.close()
    out["served"], out["import_calls"] = dict(_Stubs.served), list(_Stubs.calls)
    return out


# --- the static import walk (no torch needed) --------------------------------

def _static(sglang_dir, test_files):
    py = os.path.join(os.path.abspath(sglang_dir), "python")
    std = set(getattr(sys, "stdlib_module_names", ()))

    def modfile(name):
        p = os.path.join(py, *name.split("."))
        if os.path.isfile(os.path.join(p, "__init__.py")):
            return os.path.join(p, "__init__.py"), True
        if os.path.isfile(p + ".py"):
            return p + ".py", False
        return None, False

    def imports(path, name, is_pkg, everywhere):
        out = []

        def walk(body, cond):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if everywhere:
                        walk(node.body, True)
                    continue
                if isinstance(node, ast.ClassDef):
                    walk(node.body, cond)
                    continue
                if isinstance(node, ast.If):
                    t = ast.unparse(node.test) if hasattr(ast, "unparse") else ""
                    if "TYPE_CHECKING" in t:
                        walk(node.orelse, True)
                        continue
                    walk(node.body, True)
                    walk(node.orelse, True)
                    continue
                if isinstance(node, ast.Try):
                    walk(node.body, True)
                    for h in node.handlers:
                        walk(h.body, True)
                    walk(node.orelse, True)
                    walk(node.finalbody, cond)
                    continue
                if isinstance(node, (ast.With, ast.For, ast.While)):
                    walk(node.body, cond)
                    continue
                if isinstance(node, ast.Import):
                    out.extend((a.name, None, cond) for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = (name if is_pkg else name.rsplit(".", 1)[0]).split(".")
                        if node.level > 1:
                            parts = parts[:len(parts) - (node.level - 1)]
                        base = ".".join(parts + ([base] if base else []))
                    out.extend((base, a.name, cond) for a in node.names)

        with open(path, encoding="utf-8") as f:
            walk(ast.parse(f.read(), path).body, False)
        return out

    starts = sorted({b for rel in test_files
                     for b, _, _ in imports(os.path.join(os.path.abspath(sglang_dir), rel), "t",
                                            False, False)
                     if b.split(".")[0] == "sglang"})
    report = {"starts": starts}
    for everywhere in (False, True):
        seen, third, q = {}, {}, list(starts)
        while q:
            n = q.pop()
            if n in seen:
                continue
            f, pkg = modfile(n)
            seen[n] = f
            if f is None:
                continue
            parts = n.split(".")
            q.extend(".".join(parts[:i]) for i in range(1, len(parts)))
            for base, sub, cond in imports(f, n, pkg, everywhere):
                top = base.split(".")[0]
                if top != "sglang":
                    if top and top not in std and top != "__future__" and not cond:
                        third.setdefault(top, os.path.relpath(f, py))
                    continue
                q.append(base)
                if sub and sub != "*":
                    q.append(base + "." + sub)
        files = sorted({v for v in seen.values() if v})
        key = "with_function_level_imports" if everywhere else "module_level"
        report[key] = {
            "modules": len(files), "bytes": sum(os.path.getsize(x) for x in files),
            "unconditional_third_party": {
                t: {"first_importer": w, "importable_here": importlib.util.find_spec(t) is not None}
                for t, w in sorted(third.items())}}
    return report


# --- the parent --------------------------------------------------------------

def _child_cmd(args, mode, run=None, stubs=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--sglang", args.sglang,
           "--map", args.map]
    if run:
        cmd += ["--run", run]
    for s in stubs:
        cmd += ["--stub", s]
    for t in args.test_file:
        cmd += ["--test-file", t]
    for k in args.k or ():
        cmd += ["-k", k]
    if not args.auto_stub:
        cmd.append("--no-auto-stub")
    return cmd


def _env(args, with_map):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(os.path.abspath(args.sglang), "python"), os.path.join(ROOT, "plugin", "python")]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["SGLANG_IS_FLASHINFER_AVAILABLE"] = "false"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["STEPQ_LIBRARY"] = args.library
    env.pop("STEPQ_MAP", None)
    env.pop("SGLANG_PLUGINS", None)
    if with_map:
        env["STEPQ_MAP"] = os.path.join(ROOT, EXAMPLE_MAP) if args.map == "auto" else args.map
    return env


def _spawn(args, mode, run, stubs, log_name, with_map):
    fd, res = tempfile.mkstemp(prefix="sglang-tests-", suffix=".json")
    os.close(fd)
    cmd = _child_cmd(args, mode, run, stubs) + ["--result", res]
    log = os.path.join(args.log_dir, log_name + ".log")
    t0 = time.time()
    with open(log, "w") as lf:
        try:
            rc = subprocess.run(cmd, env=_env(args, with_map), stdout=lf, stderr=subprocess.STDOUT,
                                timeout=args.timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout after %ds" % args.timeout
    try:
        with open(res) as f:
            out = json.load(f)
    except (OSError, ValueError):
        out = {"crashed": "rc %s, no result (see %s)" % (rc, log)}
    finally:
        if os.path.exists(res):
            os.unlink(res)
    out["rc"], out["log"], out["wall_s"] = rc, log, round(time.time() - t0, 1)
    return out


def _probe_stubs(args, what="test", stubs=None):
    """Probes the import chain of the test modules (what="test") or of the
    modules the stepq hooks need (what="hooks"): a child imports them,
    stubbing each missing module it may and retrying in place; a fresh
    child then confirms the list (retrying in place can leave a half-run
    module behind). Returns (stubs, rounds, served, fatal)."""
    stubs = list(stubs if stubs is not None else
                 list(ALWAYS_STUB) + [s for s in args.stub if s not in ALWAYS_STUB])
    rounds = []
    for i in range(10):
        out = _spawn(args, "probe", what, stubs, "probe-%s-%02d" % (what, i), False)
        rounds.append({k: out.get(k) for k in ("ok", "added", "missing", "where", "error",
                                                "crashed", "wall_s")})
        added = [m for m, _ in out.get("added", [])]
        stubs += [m for m in added if m not in stubs]
        if out.get("ok") and not added:
            return stubs, rounds, out.get("served", {}), None
        if out.get("ok") or added:
            continue  # confirm in a fresh process
        name = out.get("missing")
        if name:
            what = ("name %s of %s" % tuple(reversed(name.split(":", 1))) if ":" in name else name)
            return stubs, rounds, out.get("served", {}), {
                "type": "ImportError" if ":" in name else "ModuleNotFoundError",
                "message": "%s (needed at %s) cannot be imported"
                " and is not stubbed%s" % (what, out.get("where"),
                                           "" if args.auto_stub else " (--no-auto-stub)"),
                "where": (out.get("error") or {}).get("where")}
        return stubs, rounds, out.get("served", {}), out.get("error") or {
            "type": "crash", "message": out.get("crashed")}
    return stubs, rounds, {}, {"type": "RuntimeError", "message": "10 probe rounds"}


def _cached_stubs(args, snapshot):
    path = os.path.join(args.log_dir, "stubs.json")
    key = {"commit": snapshot.get("commit"), "python": sys.version.split()[0],
           "test_files": list(args.test_file), "auto_stub": args.auto_stub,
           "extra": sorted(args.stub)}
    return path, key


def compare_runs(runs):
    """{"stepq vs baseline": rows, ...}: each stepq run's tests against its baseline's, one row per
    stepq test with both outcomes and a verdict (same; stepq refusal, the test needing what stepq
    refuses at start-up; stepq-only failure; or both outcomes when they differ otherwise)."""
    comparison = {}
    for base, mine in (("baseline", "stepq"), ("baseline-nospec", "stepq-nospec")):
        b, m = runs.get(base), runs.get(mine)
        if not b or not m or "tests" not in b or "tests" not in m or not (b["tests"] or m["tests"]):
            continue
        bo = {r["test"]: r for r in b["tests"]}
        rows = []
        for r in m["tests"]:
            # A failing subtest row ("name (case=...)") pairs with the baseline's row of its test
            # when the baseline has none of its own (there, every subtest passed).
            br = bo.get(r["test"]) or bo.get(r["test"].split(" (", 1)[0], {})
            o = br.get("outcome", "not run")
            refusal = "STEPQ_ENOTSUP" in r.get("message", "")
            if o == r["outcome"] and o in ("errored", "failed") and refusal \
                    and "STEPQ_ENOTSUP" not in br.get("message", ""):
                verdict = "stepq refusal (baseline %s too, on another cause)" % o
            elif o == r["outcome"]:
                verdict = "same"
            elif o == "passed":
                verdict = "stepq refusal" if refusal else "stepq-only failure"
            else:
                verdict = "baseline %s, stepq %s" % (o, r["outcome"])
            rows.append({"test": r["test"], "baseline": o, "stepq": r["outcome"], "verdict": verdict})
        comparison["%s vs %s" % (mine, base)] = rows
    return comparison


def _fmt_row(r):
    msg = r.get("message", "")
    if r.get("type"):
        msg = "%s: %s" % (r["type"], msg)
    if r.get("where") and r["outcome"] in ("failed", "errored"):
        msg += "  [at %s]" % r["where"][-1]
    return "  %-52s %-8s %s" % (r.get("test", r.get("check")), r["outcome"], msg[:400])


def _summary(rows):
    counts = {"ran": len(rows)}
    for o in ("passed", "failed", "errored", "skipped"):
        counts[o] = sum(1 for r in rows if r["outcome"] == o)
    return counts


def _cause(r):
    """A test row's error, short: the exception type and the message up to its first colon-led
    detail (stepq's refusals keep what they refuse)."""
    msg = r.get("message", "")
    if "STEPQ_ENOTSUP" in msg:
        m = re.search(r"does not serve (.*?)(?:\(|:|$)", msg)
        return "stepq refusal: " + (m.group(1).strip() if m else msg[:80])
    if "it is a stub" in msg:
        return "stubbed module called: " + msg.split(" called", 1)[0]
    return ("%s: %s" % (r.get("type", "?"), msg))[:160]


def _summarize(path, out_path):
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit("sglang_tests: --summarize %s: %s" % (path, e))
    runs = report.get("runs", {} if isinstance(report, dict) and report.get("kernel_check") else None)
    if not isinstance(runs, dict):
        raise SystemExit("sglang_tests: --summarize %s: no runs (not a report of this tool)" % path)
    short = {"report": os.path.basename(path), "snapshot": report.get("snapshot"),
             "stubbed": sorted((report.get("probe") or {}).get("stubbed", {})), "runs": {}}
    for name, out in runs.items():
        tests = out.get("tests") or []
        causes = {}
        for r in tests:
            if r["outcome"] in ("errored", "failed"):
                k = "%s: %s" % (r["outcome"], _cause(r))
                causes[k] = causes.get(k, 0) + 1
        short["runs"][name] = {"summary": _summary(tests), "errors_by_cause": dict(
            sorted(causes.items(), key=lambda kv: -kv[1])), "wall_s": out.get("wall_s"),
            "modified": out.get("modified"), "setup_error": out.get("setup_error"),
            "crashed": out.get("crashed")}
    short["comparison"] = {}
    for key, rows in compare_runs(runs).items():
        verdicts = {}
        for r in rows:
            verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
        short["comparison"][key] = {"verdicts": verdicts, "not_same": [r for r in rows if r["verdict"] != "same"]}
    if report.get("kernel_check"):
        short["kernel_check"] = [{k: c.get(k) for k in ("check", "outcome", "message", "detail")}
                                 for c in report["kernel_check"].get("checks", [])]
    for name, r in short["runs"].items():
        print("%s: %s" % (name, ", ".join("%s %d" % kv for kv in r["summary"].items())))
        for k, n in r["errors_by_cause"].items():
            print("  %5d %s" % (n, k))
    for key, c in short["comparison"].items():
        print("%s: %s" % (key, ", ".join("%s %d" % kv for kv in c["verdicts"].items())))
    for c in short.get("kernel_check", []):
        print("kernel check: %-8s %s%s" % (c["outcome"], c["check"], "" if c["outcome"] == "passed"
                                           else "  (%s)" % (c.get("message") or "")[:200]))
    if out_path:
        _write_json(out_path, short)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--sglang", metavar="DIR",
                   help="an extracted SGLang tree with python/ and test/ "
                        "(tools/scripts/sglang_snapshot.sh DIR makes one)")
    p.add_argument("--library", default=os.environ.get("STEPQ_LIBRARY")
                   or os.path.join(ROOT, "build-gpu", "libstepq.so"),
                   help="libstepq.so (default $STEPQ_LIBRARY, else build-gpu/libstepq.so)")
    p.add_argument("--map", default="auto",
                   help="the precision map of the stepq runs' pools, or 'auto' (default): %s "
                        "where it fits the pool's shape, else a uniform 8-bit map written for "
                        "the shape" % EXAMPLE_MAP)
    p.add_argument("--runs", default=",".join(RUNS),
                   help="comma-separated, of %s, or 'none' (default all)" % ", ".join(RUNS))
    p.add_argument("--test-file", action="append", default=[], metavar="REL",
                   help="a test file, relative to --sglang (repeatable; default %s)"
                        % ", ".join(TEST_FILES))
    p.add_argument("-k", action="append", default=[], metavar="SUBSTR",
                   help="run only the tests whose id contains SUBSTR (repeatable)")
    p.add_argument("--stub", action="append", default=[], metavar="MODULE",
                   help="also stub MODULE when it cannot be imported (repeatable)")
    p.add_argument("--no-auto-stub", dest="auto_stub", action="store_false",
                   help="stub only sgl_kernel, flashinfer and --stub modules")
    p.add_argument("--no-kernel-check", dest="kernel_check", action="store_false",
                   help="skip the check of stepq's kernel backend against SGLang's Triton kernels")
    p.add_argument("--static", action="store_true",
                   help="only walk the import statements (no torch needed) and print the chain")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-' = stdout)")
    p.add_argument("--log-dir", default=os.path.join(ROOT, "out", "sglang-tests"),
                   help="the children's output (default out/sglang-tests)")
    p.add_argument("--timeout", type=int, default=400, help="seconds per run (default 400)")
    p.add_argument("--reprobe", action="store_true",
                   help="probe the import chain again instead of reusing LOG_DIR/stubs.json")
    p.add_argument("--summarize", metavar="REPORT",
                   help="read a report this tool wrote (--json) and print, or with --json write, its "
                        "short form: per run the counts, the errors grouped by cause, the comparison's "
                        "verdicts and every row whose verdict is not 'same' (no SGLang needed)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.test_file = args.test_file or list(TEST_FILES)
    if args.summarize:
        return _summarize(args.summarize, args.json)
    if not args.sglang:
        p.error("--sglang DIR is required (or --summarize REPORT)")

    if args.child:
        fn = {"probe": _child_probe, "run": _child_run, "kernels": _child_kernels}[args.child]
        out = fn(args)
        with open(args.result, "w") as f:
            json.dump(out, f, indent=1, default=str)
        return 0

    if not os.path.isdir(os.path.join(args.sglang, "python", "sglang")):
        p.error("--sglang %s: no python/sglang there (run tools/scripts/sglang_snapshot.sh %s "
                "first)" % (args.sglang, args.sglang))
    for rel in args.test_file:
        if not os.path.isfile(os.path.join(args.sglang, rel)):
            p.error("--sglang %s: no %s there" % (args.sglang, rel))
    if args.static:
        rep = _static(args.sglang, args.test_file)
        for key in ("module_level", "with_function_level_imports"):
            r = rep[key]
            print("%s: %d SGLang modules, %d bytes" % (key, r["modules"], r["bytes"]))
        print("third-party modules imported unconditionally at module level along the chain:")
        for t, v in rep["module_level"]["unconditional_third_party"].items():
            print("  %-22s %-13s first from %s" % (
                t, "importable" if v["importable_here"] else "NOT importable", v["first_importer"]))
        if args.json:
            _write_json(args.json, {"static": rep})
        return 0
    runs = [r for r in args.runs.split(",") if r and r != "none"]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        p.error("--runs: unknown %s (of %s)" % (", ".join(bad), ", ".join(RUNS)))
    if any(r.startswith("stepq") for r in runs) or args.kernel_check:
        if not os.path.isfile(args.library):
            p.error("--library %s: no such file (build libstepq, or pass --library)" % args.library)
        if args.map != "auto" and not os.path.isfile(args.map):
            p.error("--map %s: no such file" % args.map)
    args.sglang = os.path.abspath(args.sglang)
    args.library = os.path.abspath(args.library)
    if args.map != "auto":
        args.map = os.path.abspath(args.map)
    os.makedirs(args.log_dir, exist_ok=True)

    report = {"sglang": args.sglang, "library": args.library, "map": args.map,
              "python": sys.version.split()[0], "env": {"SGLANG_IS_FLASHINFER_AVAILABLE": "false"}}
    snap = os.path.join(args.sglang, "SNAPSHOT")
    if os.path.isfile(snap):
        with open(snap) as f:
            report["snapshot"] = dict(l.split(": ", 1) for l in f.read().splitlines() if ": " in l)
    need_hooks = any(r.startswith("stepq") for r in runs) or args.kernel_check
    cache_path, cache_key = _cached_stubs(args, report.get("snapshot", {}))
    cached = None
    if not args.reprobe and os.path.isfile(cache_path):
        with open(cache_path) as f:
            cached = json.load(f)
        if cached.get("key") != cache_key or (need_hooks and not cached.get("hooks_probed")):
            cached = None
    if cached:
        print("reusing the stub list of %s (--reprobe probes again)" % cache_path)
        stubs, served, fatal = cached["stubs"], cached["served"], None
        report["probe"] = {"reused": cache_path, "stub_candidates": stubs, "stubbed": served}
        need_hooks = False
    else:
        print("probing the import chain ...", flush=True)
        stubs, rounds, served, fatal = _probe_stubs(args)
        report["probe"] = {"rounds": rounds, "stub_candidates": stubs, "stubbed": served}
    if not fatal and need_hooks:
        # The modules that stepq's hooks and the kernel check import (not the test's).
        stubs, h_rounds, h_served, h_fatal = _probe_stubs(args, "hooks", stubs)
        report["probe"].update(hook_rounds=h_rounds, stub_candidates=stubs,
                               hook_modules_error=h_fatal)
        served = dict(h_served, **served)
        report["probe"]["stubbed"] = served
        if h_fatal:
            print("the modules of stepq's backend hooks cannot be imported (the hooks will not "
                  "apply): %s: %s" % (h_fatal.get("type"), h_fatal.get("message")))
    print("stubbed (not importable here, needed by the chain):")
    for name, where in sorted(served.items()) or [("(none)", "")]:
        print("  %-40s first imported at %s" % (name, where))
    if not fatal and not cached:
        with open(cache_path, "w") as f:
            json.dump({"key": cache_key, "stubs": stubs, "served": served,
                       "hooks_probed": any(r.startswith("stepq") for r in runs)
                       or args.kernel_check}, f, indent=1)
    if fatal:
        report["fatal"] = fatal
        print("the test module cannot be imported: %s: %s" % (fatal.get("type"), fatal.get("message")))
        if fatal.get("where"):
            print("  at " + " <- ".join(reversed(fatal["where"])))
        _write_json(args.json, report)
        return 1

    failed = False
    report["runs"] = {}
    for run in runs:
        print("\n== run %s%s" % (run, " (modified setup: speculative_num_draft_tokens=None)"
                                 if run.endswith("-nospec") else ""), flush=True)
        out = _spawn(args, "run", run, stubs, "run-" + run, run.startswith("stepq"))
        report["runs"][run] = out
        if _child_failed(out):
            failed = True
            continue
        if out.get("stepq"):
            print("  stepq entry point: registered %s; installed entry points: %s"
                  % (out["stepq"]["registered"], out["stepq"]["installed_entry_points"]))
        for name, where in out.get("reregistered", []):
            print("  transformers already had %s: SGLang's registration replaced it (at %s)" % (name, where))
        for r in out["tests"]:
            print(_fmt_row(r))
        s = _summary(out["tests"])
        out["summary"] = s
        print("  ran %(ran)d: %(passed)d passed, %(failed)d failed, %(errored)d errored, "
              "%(skipped)d skipped" % s)
        if out.get("hook_status"):
            print("  stepq hooks: %s" % ", ".join("%s %s" % (t.rsplit(".", 2)[-2] + "."
                                                            + t.rsplit(".", 1)[-1], v)
                                                   for t, v in sorted(out["hook_status"].items())))

    comparison = compare_runs(report["runs"])
    for key, rows in comparison.items():
        print("\n== %s" % key)
        for row in rows:
            print("  %-52s baseline %-8s stepq %-8s %s" % (row["test"], row["baseline"],
                                                        row["stepq"], row["verdict"]))
    report["comparison"] = comparison

    if args.kernel_check:
        print("\n== stepq kernel backend vs SGLang's Triton kernels (not an SGLang test)", flush=True)
        out = _spawn(args, "kernels", None, stubs, "kernel-check", False)
        report["kernel_check"] = out
        if _child_failed(out):
            failed = True
        for r in out.get("checks", []):
            row = dict(r)
            if r["outcome"] == "passed":
                row["message"] = json.dumps(r.get("detail"), default=str)
            print(_fmt_row(row))
        if out.get("partial"):
            failed = True
            print("  cut off by --timeout %d after the checks above (rc %s); the rest did not run"
                  % (args.timeout, out.get("rc")))
    print("\nlogs: %s" % args.log_dir)
    _write_json(args.json, report)
    return 1 if failed else 0


def _child_failed(out):
    """Prints what a run or kernel-check child met while importing (stub calls) and, when it
    crashed or its setup raised, that it could not run and where; True in that case."""
    for call in out.get("import_calls", [])[:20]:
        print("  stub called while importing: %s at %s" % tuple(call))
    if not (out.get("crashed") or out.get("setup_error")):
        return False
    e = out.get("setup_error") or {}
    print("  could not run: %s %s %s" % (out.get("crashed", ""), e.get("type", ""), e.get("message", "")))
    if e.get("where"):
        print("  at " + " <- ".join(reversed(e["where"])))
    return True


def _write_json(path, report):
    if not path:
        return
    text = json.dumps(report, indent=1, default=str)
    if path == "-":
        print(text)
    else:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
        print("report: %s" % path)


if __name__ == "__main__":
    sys.exit(main())
