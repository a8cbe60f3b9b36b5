"""Benchmarks: model-shape registry (:mod:`.shapes`), minimum-work formulas (:mod:`.flops`),
the per-case harness (:mod:`.harness`) and ``nki-lib bench`` (:mod:`.cli`)."""
