"""Tests of ``model/``: the processes against exact oracles, the network, the spec, the samplers."""
