"""Training: the loop, its objective, the DeepSpeed engine and its plan, EMA, validation and
throughput."""
