"""A setting declared once, on its config field (`fields`: flag, environment variable, default,
help, parser from `values`), and where its value comes from: flag > environment > job file (TOML)
> default (`settings`, `configfile`)."""
