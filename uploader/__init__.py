"""The uploader: N processes per node bound to one durable consumer of that node's file-ready
events. Moves each spool file to the destination, verifies it, deletes the local copy, and only
then acks. `hsx upload` runs it."""
