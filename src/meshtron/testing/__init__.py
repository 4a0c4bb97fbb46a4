"""Test machinery that ships with the package: a pool of long-lived gloo worker processes
(`comm/workers.py`), the parity harness that runs a layout against the single-device run (`parity.py`), and
the tiny models the tests share (`tiny.py`)."""
