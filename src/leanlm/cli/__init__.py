"""The `leanlm` command."""
