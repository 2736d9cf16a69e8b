"""`mhc compare`: run (train every kind on the same batches), report (report.json, report.md and
the figures), seeds (paired statistics over seeds), stats (Student's t without scipy), plots (the
report's figures)."""
