"""What the `stepq bench decode` checks share: the command's run, the ok/FAIL line per check
and its tally.

  from bench_decode_checks import bench, check, failed
  p = bench(EXE, ["MAP", "--json"], env)
  check(cond, "what it asserts", "detail shown on failure")
  sys.exit(1 if failed() else 0)
"""
import os
import subprocess

_failures = 0


def check(ok, what, detail=""):
    """Prints one line, `ok  WHAT` or `FAIL WHAT: DETAIL`, and counts a failure."""
    global _failures
    print("%s %s%s" % ("ok  " if ok else "FAIL", what, "" if ok else ": " + detail))
    _failures += not ok


def failed():
    """How many checks have failed so far."""
    return _failures


def bench(exe, args, env=None, timeout=300):
    """`EXE bench decode ARGS...`, its output captured as text (progress off unless env says)."""
    env = dict(os.environ, STEPQ_PROGRESS="off") if env is None else env
    return subprocess.run([exe, "bench", "decode"] + args, capture_output=True, text=True, env=env,
                          timeout=timeout)
