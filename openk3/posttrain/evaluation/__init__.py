"""Post-training evaluation: every model on every (domain, effort) cell (evaluate.py), the plots (plots.py)
and the report over several models (report.py: report.json, report.md; `openk3 eval`)."""
