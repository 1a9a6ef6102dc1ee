"""What a job leaves in its destination: the sample-file format and key layout, the destinations
(s3://, file://), the index of stored samples, and the reader trainers use; local file safety."""
