"""Analysis on top of models and runs: the token inspector and the method comparison."""
