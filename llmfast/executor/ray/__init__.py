"""The `ray` backend: one Ray actor per rank, on a local or a remote cluster. Imports
ray only when the backend is chosen."""
