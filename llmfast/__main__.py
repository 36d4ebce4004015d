from llmfast.cli.main import main

main()
