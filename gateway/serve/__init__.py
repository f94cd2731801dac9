"""The `prefixgate serve` command: flags, their help, from flags to settings, and running the server; imports every room."""
