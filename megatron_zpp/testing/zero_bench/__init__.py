"""bench/zero.py as a library: its systems and model (systems.py), its launches on the emulated
cluster (launch.py), its figures (results.py) and its printed report (report.py)."""
