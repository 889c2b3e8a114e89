"""The ``unmask`` subcommands, one module per group: each parses its flags, calls the
libraries below (data_prep, pipeline, evaluation, orchestration's own), and prints.

Each module imports its heavy libraries (what pulls in torch, DeepSpeed, Ray or MLflow) in
the handler that runs the command, not at the top: building the parser for `unmask --help`
or `unmask prep` must not pay seconds for libraries the command does not use."""
