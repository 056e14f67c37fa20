"""The built-in tasks, one file each: `image_classification`, `segmentation`, `causal_lm`
(`hpctrain.train.task.BUILTIN_TASKS` names them)."""
