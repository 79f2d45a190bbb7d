"""Analysis on top of models and runs: the token inspector, the method comparison, and compiling a run's
programs for a TPU slice (``ict-jax compile``, docs/tpu.md)."""
