"""stepq's exceptions."""

from . import _lib


class StepqError(RuntimeError):
    """A failure the library (or these bindings, before calling it) reported.

    Attributes: ``status`` (the negative stepq_status value), ``name`` (its
    symbolic name, e.g. "STEPQ_EDOUBLEFREE") and ``message`` (the detail text
    the library kept for the failure, e.g. "ids[1]: slot 3 is not allocated").
    ``str()`` gives "NAME: message".
    """

    def __init__(self, name, message, status=None):
        self.name = name
        self.message = message
        self.status = _lib.STATUS.get(name) if status is None else status
        super().__init__("%s: %s" % (name, message) if message else name)


class StepqArgumentError(StepqError, ValueError):
    """A bad argument refused in Python before the library was called.

    Both a StepqError (status STEPQ_EINVAL or STEPQ_ESHAPE, the status the
    library would give) and a ValueError; the message names the argument.
    """


def check(status):
    """Returns ``status`` when it is >= 0, else raises its StepqError.

    The message is the calling thread's stepq_last_error(): the library sets
    it per thread, so another thread's failure cannot replace it, and ctypes
    runs the call and this read on the same thread.
    """
    if status >= 0:
        return status
    raise StepqError(_lib.status_name(status), _lib.last_error(), status)


def bad_arg(message, name="STEPQ_EINVAL"):
    """A StepqArgumentError to raise for a refused argument."""
    return StepqArgumentError(name, message)
