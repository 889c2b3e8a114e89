"""The ``unmask`` subcommands, one module per group: each parses its flags, calls the
libraries below (data_prep, pipeline, evaluation, orchestration's own), and prints."""
