"""The wire contract: messages, headers, the JetStream topology and connection, the job's spec and
stored samples, progress events and their counting, and the workers' shared start-up and shutdown."""
