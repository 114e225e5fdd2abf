"""Tools behind the command line: validate (and later bench, profile, tune)."""
