"""The `stepline` command line: `main` builds the parser and dispatches; each command lives in a module of its own."""
