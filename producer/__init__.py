"""The producer: reads a dataset (JSONL, Parquet or a `datasets` save_to_disk folder; token rows or
chat rows tokenized with the model's chat template), applies --on-long, stores the job's samples
in the object store, plans token-budgeted batches, records the job spec, and publishes one
descriptor per batch (deduplicated by batch id). `hsx produce` runs it.

Modules: dataset (formats, row checks), chat (chat template, assistant masks), lengths
(--on-long), inputs (dataset -> samples, the input report), stored (samples and report in the
object store; `load_tokenized` for other code), main (the plan and the run; packing is hsx/packing.py)."""
