"""The target model as the job names it: layer selection, reading a model's config, and devices."""
