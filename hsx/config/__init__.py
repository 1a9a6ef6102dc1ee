"""Where each setting's value comes from: flag > environment > job file (TOML) > default."""
