"""The wire contract: messages, headers, the JetStream topology and connection, the job's spec
(hsx/job.py) as the KV bucket holds it, read and checked, the stored samples, progress events
and their counting, and the workers' shared start-up and shutdown."""
