"""The `stepline` command line: `main` builds the parser and dispatches; each command is a module of its own (its
HELP, DESCRIPTION, add_arguments and run), and `options` holds what several commands say alike."""
