"""Whole commands through their CLI: whale run's bad input, study, compare, report, status, calibrate, tracking."""
