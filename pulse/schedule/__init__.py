"""Schedules as data: per-device action lists, generators, passes, validation."""
