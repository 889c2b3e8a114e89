"""Training: the loop (``trainer``), the parts it is built from (``build``), the objective, the
DeepSpeed engine and its plan, EMA, validation and throughput. The manual: docs/training.md."""
