"""The test suite, one folder per capability. A package (each folder too), so that a test module is imported as
tests.<folder>.<module>: two folders may hold modules of one name, and no folder (domains/, say) stands in for the
project's own package of that name on sys.path."""
