"""Rollouts and evaluation: the jitted KV-cache sampler, text in / text out generation, pass@k.
docs/sampler.md, docs/evaluation.md."""
