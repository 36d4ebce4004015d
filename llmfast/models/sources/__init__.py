"""Where a model comes from: `--model` resolution (`ModelSource`), the `random:` presets
and their tokenizer, and the default model with its cache of converted GGUF files."""
