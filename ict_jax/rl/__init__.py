"""The maths of one RL update (docs/method.md): token statistics, selectors, losses, metrics, the rollout
batch, the train state and the one compiled train step, SFT. Never imports the model, the sampler or data."""
