"""Problems and prompts: examples, their sources (files, tfds, reasoning-gym), procedural tasks, datasets by
name, prompt templates, tokenised and bucketed prompt batches. docs/data.md."""
