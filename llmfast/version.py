"""The package version (one place; bench results record it)."""

__version__ = "0.1.0"
