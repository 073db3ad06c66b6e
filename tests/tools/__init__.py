"""Command-line helpers of the tests and the README, run as scripts (CONTRIBUTING.md)."""
