"""The code's structure: its import graph and the boundaries between its parts."""
