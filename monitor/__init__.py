"""The monitor: folds progress events and JetStream queue state into a log stream, one line per
interval, and a final summary. `hsx monitor` runs it; `hsx status` takes one reading."""
