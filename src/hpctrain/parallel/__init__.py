"""Parallelism: the device mesh and DDP/FSDP2/HSDP/TP applied in one ordered function
(`parallelize.py`), precision and the training plan (`precision.py`), and the model of what
each strategy sends over the network (`comms.py`). Never imports tasks or the loop."""
