"""The `infinity` command: argument parsing and printing. All work is done by the library."""
