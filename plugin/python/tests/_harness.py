"""What the stepq tests share: finding the package, the library and the data,
and running every test_* function of a module without pytest.

Each test module runs under pytest and as a plain script (``python3
test_x.py``: every test_* function in order, exit 1 on a failure, 77, the
build system's "skipped", when every test skipped).
"""

import contextlib
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(HERE)  # plugin/python
SOURCE_ROOT = os.environ.get("STEPQ_SOURCE_ROOT") or os.path.dirname(os.path.dirname(PACKAGE_ROOT))
if PACKAGE_ROOT not in sys.path:
    sys.path.append(PACKAGE_ROOT)  # after PYTHONPATH, which wins
if not os.environ.get("STEPQ_LIBRARY"):
    # A developer's run from the source tree: the default build folder.
    _built = os.path.join(SOURCE_ROOT, "build", "libstepq.so")
    if os.path.exists(_built):
        os.environ["STEPQ_LIBRARY"] = _built

try:
    import pytest
except ImportError:
    pytest = None


class Skipped(Exception):
    pass


# What skip() raises: pytest's own exception where pytest is importable (even
# when the module runs as a script), else Skipped.
SKIP_EXCEPTIONS = (Skipped,) + ((pytest.skip.Exception,) if pytest is not None else ())


def skip(reason):
    if pytest is not None:
        pytest.skip(reason)
    raise Skipped(reason)


def need_numpy():
    """numpy, or a skip (the host backend's arrays)."""
    try:
        import numpy
    except ImportError:
        skip("numpy is not installed for %s" % sys.executable)
    return numpy


def data(*parts):
    """A path in the repository (config/calibrated/...)."""
    return os.path.join(SOURCE_ROOT, *parts)


def script(name):
    """The module tools/scripts/NAME.py of the source tree (the GPU host's scripts, whose pure
    parts these tests exercise without torch)."""
    d = data("tools", "scripts")
    sys.path.insert(0, d)
    try:
        return __import__(name)
    finally:
        sys.path.remove(d)


@contextlib.contextmanager
def raises(exc, name=None, match=None):
    """Like pytest.raises: the block must raise `exc`; `name` checks a
    StepqError's status name, `match` a text its str() contains."""
    try:
        yield
    except exc as e:
        if name is not None and getattr(e, "name", None) != name:
            raise AssertionError("expected %s, got %r" % (name, e)) from e
        if match is not None and match not in str(e):
            raise AssertionError("expected %r in %r" % (match, str(e))) from e
        return
    raise AssertionError("%s was not raised" % exc.__name__)


def main(namespace):
    """Runs every test_* function of a module's namespace; the exit status."""
    tests = [(n, f) for n, f in namespace.items() if n.startswith("test_") and callable(f)]
    failed = skipped = 0
    for name, fn in tests:
        try:
            fn()
        except SKIP_EXCEPTIONS as e:
            skipped += 1
            print("SKIP %s: %s" % (name, e))
        except Exception:
            failed += 1
            print("FAIL %s" % name)
            traceback.print_exc()
        else:
            print("ok   %s" % name)
        sys.stdout.flush()
    print("%d passed, %d failed, %d skipped" % (len(tests) - failed - skipped, failed, skipped))
    if failed:
        return 1
    return 77 if tests and skipped == len(tests) else 0
