"""What a job leaves in its destination: the sample-file format and key layout, the destinations
(s3://, file://), the index of stored samples, the reader trainers use, the trainers' own file
formats (`trainers`, for hsx export); local file safety."""
