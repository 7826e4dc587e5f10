"""The transformers names stepq hooks: plugin/python/stepq/hf_names.py, loaded by path.

That file is the one list of names (config fields, layer classes, kernel
functions per transformers release) for the package's transformers cache
(stepq.hf) and for the scripts here (capture_traces.py, nll_eval.py,
served_path.py, tests/tools/check_hf_names.py). It imports nothing of stepq,
so loading it here needs neither the library nor torch; when the package's own
copy is already imported (stepq.hf_names), that module object is used, so its
HFNamesError is the one class everybody catches.
"""
import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "plugin", "python", "stepq",
                     "hf_names.py")


def _load():
    if "stepq.hf_names" in sys.modules:
        return sys.modules["stepq.hf_names"]
    if "_stepq_hf_names" in sys.modules:
        return sys.modules["_stepq_hf_names"]
    spec = importlib.util.spec_from_file_location("_stepq_hf_names", os.path.normpath(_PATH))
    if spec is None:
        raise ImportError("hf_names: cannot load %s" % os.path.normpath(_PATH))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_stepq_hf_names"] = mod
    spec.loader.exec_module(mod)
    return mod


_mod = _load()
globals().update({k: v for k, v in vars(_mod).items() if not k.startswith("__")})
