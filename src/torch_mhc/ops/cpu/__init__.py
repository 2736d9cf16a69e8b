"""The CPU implementation: ops (the Ops functions and their custom ops), native (ctypes
bindings of the C kernels), build (compiles native.c on first use, cached per machine)."""
