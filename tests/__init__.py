"""tokenmill test suite."""
