"""What tests, benches and tools share beyond the package's own API (importable; no sys.path tricks)."""
