"""Verifiable rewards: pure answer checks (:mod:`.checks`) and the worker pool that runs them under a hard
time limit (:mod:`.pool`). Imports nothing else of ict_jax. docs/rewards.md."""
