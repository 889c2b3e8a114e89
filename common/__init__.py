"""What every package shares, importing nothing of ours: the user-error type and output-path
checks, atomic file writes, logging setup, version and git provenance, and the Ray helper
that keeps a local Ray on 127.0.0.1. The bottom floor of the house (DESIGN.md)."""
