"""The producer: reads a dataset, plans token-budgeted batches, records the job spec, and
publishes one descriptor per batch (deduplicated by batch id). `hsx produce` runs it."""
