"""NKI kernels of the attention ops: ``fwd`` (forward), ``bwd`` (backward), ``tiles`` (shared planning and mask helpers)."""
