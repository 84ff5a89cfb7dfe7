"""A run mirrored to experiment trackers as it goes: MLflow, TensorBoard event files, Weights & Biases offline.

The run directory stays the truth. records.py reads what it holds (config, weight steps, harness iterations,
cycle rows, report); session.py sends each tracker what it has not yet had, from a thread of its own, and keeps
in <run_dir>/tracking.json each tracker's run id and how far it got, so a relaunch continues the same tracker run
without logging a step twice. Trackers are imported only when a config names them (registry.py). A tracker that
fails or does not answer within `tracking.timeout_s` is named in one warning and one event, and dropped for the
launch: the run goes on.
"""

from whale_ray.tracking.session import log_comparison, track_run, trial_tracking

__all__ = ["log_comparison", "track_run", "trial_tracking"]
