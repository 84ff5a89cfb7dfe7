"""The WHALE loop in process: schedules, selection, the archive, the config and the run directory."""
