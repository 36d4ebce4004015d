"""Cheap Triton launches: the compiled kernel cached per specialization and its launcher
called directly, plus an offline sm_90 target for testing that path without a GPU; the
per-GPU-model tables of launch configurations shipped with the package (device_tables)."""
