"""Small shared helpers with no llmfast dependencies: error text, flag parsing, GC
freezing, host memory, cache paths, progress callbacks, value checks."""
