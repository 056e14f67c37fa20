"""Launching runs: local processes, cluster profiles, sbatch scripts, submitit, requeue.

The path of one run and the preemption/requeue contract are in docs/architecture.md.
"""
