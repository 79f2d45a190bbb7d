"""The ``ict-jax`` command line: :mod:`ict_jax.cli.main` parses and dispatches, one module per subcommand
(``info``, ``train``/``sft``, ``eval``, ``sample``, ``inspect``, ``compare``, ``export``). argparse lives
only here; the work lives in the library."""
