from llmfast.cli import main

main()
