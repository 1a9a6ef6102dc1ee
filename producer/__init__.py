"""The producer: reads a dataset (JSONL, Parquet or a `datasets` save_to_disk folder; token rows or
chat rows tokenized with the model's chat template), sets aside what the job's settings say,
stores the job's samples in the object store, plans token-budgeted batches, records the job spec,
and publishes one descriptor per batch (deduplicated by batch id), a round at a time. `hsx
produce` runs it.

Modules (tests/test_layout.py holds this list to the folder): `main` (the command's entry and the
dry run), `config` (its settings); reading: `sources/` (the file formats), `rows/` (the row
forms), `chat`, `chat_pool`, `conventions`, `reply_spans` (chat rows tokenized and masked),
`lengths` (--on-long), `inputs` (dataset -> samples, the input report), `rounds` (the dataset read
a round at a time); the job: `planning` (the plan and its fingerprint; packing is
hsx/packing.py), `draft` (the spec at each step, the job sized), `estimate` and `measure` (its
size), `publishing` (the one route: check, record, publish each round), `rerun` (what a rerun
finds on record), `specrecord` (the spec in KV), `resume` (what is queued or done), `preflight`
(what can refuse the job), `stored` (samples and report in the object store, and their loader for
other code), `bundle` (the job's bundle at its destination)."""
