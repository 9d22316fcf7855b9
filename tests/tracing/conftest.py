"""Fixtures for tracing tests: the shared embedded store lives in tests/conftest.py."""
