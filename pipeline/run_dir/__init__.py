"""The run directory: its layout, its lock, and its checkpoints (integrity, safe loading, resharding)."""
