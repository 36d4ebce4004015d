"""Cheap Triton launches: the compiled kernel cached per specialization and its launcher
called directly, plus an offline sm_90 target for testing that path without a GPU."""
