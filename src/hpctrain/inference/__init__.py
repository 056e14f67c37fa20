"""Using a trained checkpoint: `hpctrain eval`, `predict`, `export` and `generate`.

`session` gives every rank of an eval or predict job the checkpoint's model, wrapped as
training would wrap it, and an evaluation loader; `evaluate` and `predict` are those verbs;
`export` writes consolidated weights (`.pt`, safetensors, a Hugging Face folder); `generate`
continues a prompt with a causal_lm checkpoint; `target` resolves which run a command line
names (light: no torch for a config or a run folder). The weights themselves are read by
`hpctrain.checkpoint.weights`.

Nothing is imported here: the CLI imports the module a verb needs when it runs.
"""
