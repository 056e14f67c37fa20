"""What runs inside the allocation once a job starts: the attempt loop's steps
(`attempts.py`), the restart policy (`restart_policy.py`), the health probe (`probe.py`), the
rank watcher (`watch.py`), goodput and its report (`goodput.py`, `goodput_report.py`) and the
node failure rate (`failure_rate.py`).

Below `launch/` (the login node's side, which renders the job scripts that call these
modules) and free of torch: the job shell runs `python -m hpctrain.resilience.attempts` between
attempts, so its start-up is part of every restart.
"""
