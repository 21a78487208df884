"""Benchmarks: each measures the platform beside a baseline in the same run. Run them all with
``.venv/bin/python -m bench`` (writes ``docs/benchmarks.md``)."""
