"""Pins and their verification at their public sources."""
