"""NKI kernels of the attention ops: ``flash_attention_fwd*`` (forward), ``flash_attention_bwd*`` (backward), ``decode_attention_fwd*`` (decode), ``tiles`` (shared planning and mask helpers)."""
