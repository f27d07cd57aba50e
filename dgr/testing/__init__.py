"""Test support shipped with dgr: model fixtures and helpers for the project's tests."""
