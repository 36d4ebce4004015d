"""`llmfast chat`: the terminal command, the session it drives (history, settings,
slash commands) and the reply-loop detector."""
