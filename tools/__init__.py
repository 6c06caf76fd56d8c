"""Command-line scripts, not a library; a package only so that the tests can import them."""
