"""Orchestration: Ray job submission and tracking, the Ray Train launcher, cluster runs."""
