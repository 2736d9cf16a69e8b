"""The Triton implementation: kernels (the @triton.jit code), ops (launch plans and custom
ops), aot (ahead-of-time compiles for sm_80 / sm_90 without a GPU). Imported only when asked
for: importing torch_mhc never imports triton."""
