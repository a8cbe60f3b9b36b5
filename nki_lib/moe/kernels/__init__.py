"""NKI kernels of the MoE ops (router forward/backward; the expert MLP kernels live beside them).

Kernels import NKI only through ``nki_lib._nki``; launchers convert torch tensors and raise
``nki_lib.dispatch.Unsupported`` before launching anything they cannot serve.
"""
