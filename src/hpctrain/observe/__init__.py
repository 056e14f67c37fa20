"""Observation: step metrics and stragglers (`metrics.py`), trackers (W&B, MLflow,
TensorBoard), hang stacks (`hangs.py`), profiling, GPU counters, OOM snapshots (`memory.py`)
and plots. Never imports the loop (`hpctrain.train`)."""
