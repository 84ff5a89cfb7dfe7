"""whale-ray: WHALE (weight-harness alternating learning) as a Ray-native actor system."""

__version__ = "0.1.0"
