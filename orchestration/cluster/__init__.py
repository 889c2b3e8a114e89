"""Work on a Ray cluster: Ray Jobs submission with its upload, and the Ray Train launcher."""
