"""Developer tools (run as scripts; importable as `tools.*` from the repository root)."""
