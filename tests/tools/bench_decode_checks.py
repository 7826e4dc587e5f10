"""What the `stepq bench decode` checks share: the ok/FAIL line per check and its tally.

  from bench_decode_checks import check, failed
  check(cond, "what it asserts", "detail shown on failure")
  sys.exit(1 if failed() else 0)
"""

_failures = 0


def check(ok, what, detail=""):
    """Prints one line, `ok  WHAT` or `FAIL WHAT: DETAIL`, and counts a failure."""
    global _failures
    print("%s %s%s" % ("ok  " if ok else "FAIL", what, "" if ok else ": " + detail))
    _failures += not ok


def failed():
    """How many checks have failed so far."""
    return _failures
