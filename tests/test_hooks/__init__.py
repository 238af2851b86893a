"""The hook math on real gloo ranks: half precision, int8 and its C and
Triton kernels, PowerSGD, the comm worker, two-level and FSDP2 forms, and
the package's torch-only promise."""
