"""Tests of Ray Jobs, the upload and the Ray Train launcher (``orchestration/cluster/``)."""
