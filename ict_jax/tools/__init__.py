"""Analysis on top of models and runs: the token inspector, the method comparison and the paper's token
diagnostics."""
