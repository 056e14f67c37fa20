"""Tasks: what to learn. The Task protocol (`task.py`), class names (`classes.py`) and the
built-in tasks, one file each: `image_classification`, `segmentation`, `causal_lm`
(`hpctrain.tasks.task.BUILTIN_TASKS` names them); `vision.py` holds what the image tasks share.

A task builds the model, the per-sample transforms and the loss; it never imports the loop
(`hpctrain.train`)."""
