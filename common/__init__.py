"""What every package shares, importing nothing of ours: the user-error type, the owner of
output paths (``common.outputs``: what a command may write where, and how), atomic file
writes, logging setup, version and git provenance, and the Ray helper that keeps a local Ray
on 127.0.0.1. The bottom floor of the house (DESIGN.md)."""
