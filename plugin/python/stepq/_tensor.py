"""Duck-typed views of numpy arrays and torch tensors for the C API.

torch is never imported here: a torch tensor is recognised by its methods
(``data_ptr``, ``stride``, ``device``), a numpy array by
``__array_interface__``. Each view carries the data pointer, the shape, the
strides in elements, the dtype as a stepq dtype name ("fp32", "bf16",
"fp16", or the foreign name for anything else) and the device ("cpu", or
("cuda", index)).
"""

import ctypes

from .errors import bad_arg

_NUMPY_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "int32",
                 "uint8": "uint8"}
_TORCH_DTYPES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16",
                 "torch.int32": "int32", "torch.uint8": "uint8"}
_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "int32": 4, "uint8": 1}


class View:
    __slots__ = ("obj", "name", "ptr", "shape", "strides", "dtype", "device")

    def __init__(self, obj, name):
        self.obj, self.name = obj, name
        if hasattr(obj, "data_ptr") and hasattr(obj, "stride") and hasattr(obj, "device"):
            self.ptr = obj.data_ptr()
            self.shape = tuple(obj.shape)
            self.strides = tuple(obj.stride())
            self.dtype = _TORCH_DTYPES.get(str(obj.dtype), str(obj.dtype))
            dev = obj.device
            self.device = "cpu" if dev.type == "cpu" else (dev.type, dev.index or 0)
        elif hasattr(obj, "__array_interface__"):
            ai = obj.__array_interface__
            self.ptr = ai["data"][0]
            self.shape = tuple(obj.shape)
            item = obj.dtype.itemsize
            if any(s % item for s in obj.strides):
                raise bad_arg("%s: strides %s are not a multiple of the element size"
                              % (name, obj.strides))
            self.strides = tuple(s // item for s in obj.strides)
            self.dtype = _NUMPY_DTYPES.get(obj.dtype.name, obj.dtype.name)
            self.device = "cpu"
        else:
            raise bad_arg("%s: a numpy array or a torch tensor is needed, not %s"
                          % (name, type(obj).__name__))

    @property
    def itemsize(self):
        return _ITEMSIZE.get(self.dtype, 0)

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n


def view(obj, name, device, dtypes):
    """A View of obj, refused unless it lives on `device` with one of `dtypes`."""
    v = View(obj, name)
    if v.device != device:
        raise bad_arg("%s: on %s, the pool's tensors live on %s" % (name, _dev(v.device), _dev(device)))
    if v.dtype not in dtypes:
        raise bad_arg("%s: dtype %s, expected %s" % (name, v.dtype, " or ".join(dtypes)))
    return v


def _dev(d):
    return d if isinstance(d, str) else "%s:%d" % d


def per_request(v, batch, inner, what):
    """The request stride (elements) of v, whose rows hold `inner` shape each.

    v is [batch, *inner] or [batch, prod(inner)], each request's elements
    contiguous in row-major order; requests may be any stride apart as long
    as rows do not overlap (the C API's `*_stride`). Returns 0 for packed rows.
    """
    n_inner = 1
    for d in inner:
        n_inner *= d
    shapes = [(batch,) + tuple(inner), (batch, n_inner)]
    if v.shape not in shapes:
        raise bad_arg("%s: shape %s, expected %s (%s)" % (v.name, list(v.shape),
                      " or ".join(str(list(s)) for s in shapes), what), "STEPQ_ESHAPE")
    # The inner dims must be row-major contiguous (size-1 dims may have any stride).
    expect = 1
    for d, s in zip(reversed(v.shape[1:]), reversed(v.strides[1:])):
        if d != 1 and s != expect:
            raise bad_arg("%s: each request's %s elements must be contiguous (strides %s)"
                          % (v.name, what, list(v.strides)))
        expect *= d
    if batch <= 1:
        return 0
    stride = v.strides[0]
    if stride < n_inner:
        raise bad_arg("%s: requests are %d elements apart, fewer than the %d of one request"
                      % (v.name, stride, n_inner))
    return 0 if stride == n_inner else stride


def contiguous_1d(v, n, what):
    """Checks that v is a contiguous 1-D tensor of n elements."""
    if v.shape != (n,) or (n > 1 and v.strides[0] != 1):
        raise bad_arg("%s: expected a contiguous [%d] tensor of %s, got shape %s strides %s"
                      % (v.name, n, what, list(v.shape), list(v.strides)), "STEPQ_ESHAPE")


def exact(v, shape, what):
    """Checks that v is a C-contiguous tensor of exactly `shape`."""
    if v.shape != tuple(shape):
        raise bad_arg("%s: shape %s, expected %s (%s)" % (v.name, list(v.shape), list(shape), what),
                      "STEPQ_ESHAPE")
    expect = 1
    for d, s in zip(reversed(v.shape), reversed(v.strides)):
        if d != 1 and s != expect:
            raise bad_arg("%s: must be contiguous (strides %s)" % (v.name, list(v.strides)))
        expect *= d


def ptr(v):
    return ctypes.c_void_p(v.ptr) if v is not None else None
