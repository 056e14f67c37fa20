"""Starts a thread when imported: a fork server that preloads it must refuse to fork
(tests/resilience/test_forkserver.py)."""

import threading
import time

threading.Thread(target=lambda: time.sleep(3600), daemon=True).start()
