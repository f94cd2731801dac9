"""prefixgate subpackage."""
