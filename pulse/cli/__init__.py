"""The `pulse` command line."""
