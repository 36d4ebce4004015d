"""The frontend side of the engine, in whichever process holds the tokenizer: prompts
made into checked core requests (`input_processor`), the core's token ids made into
`RequestOutput`s (`output_processor`, with `detokenizer`), and the picklable tokenizer
they share (`tokenizer`). None of it runs in the engine core's busy loop."""
