"""The GPU consumer: one process per device. Loads the model once, runs each batch's forward
with hooks on the selected layers only, writes one safetensors file per sample into the local
spool, announces each file, and only then acks the batch. `hsx consume` runs it."""
