"""`llmfast bench`: the command, its checks before anything runs, its Rich tables and
its plot."""
