"""The `tiledsl` command: one module per subcommand."""
