"""Subcommands of the ``skippy`` command line (one module each)."""
