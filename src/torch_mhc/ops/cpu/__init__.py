"""The CPU implementation: ops (the Ops functions and their custom ops), native (ctypes
bindings of the C kernels), decode (a connection's prepared calls without autograd; their
two C calls go through decode_calls.c, a CPython extension, where it builds), build
(compiles native.c and decode_calls.c on first use, cached per machine)."""
