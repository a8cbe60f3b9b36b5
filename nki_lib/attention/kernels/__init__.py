"""NKI kernels of the attention ops: ``flash_attention_fwd*`` (forward), ``flash_attention_bwd*``
(backward), ``decode_attention_fwd*`` (decode), ``tiles`` (shared planning and mask helpers).

Kernels import NKI only through ``nki_lib._nki``; a launcher raises ``nki_lib.dispatch.Unsupported``
for what its kernel cannot serve and otherwise returns a ``nki_lib.dispatch.KernelLaunch``.
"""
