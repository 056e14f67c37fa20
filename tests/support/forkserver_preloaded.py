"""Imported by the fork server of tests/resilience/test_forkserver.py before it forks: its
children find it in sys.modules (they were forked, not started afresh)."""
