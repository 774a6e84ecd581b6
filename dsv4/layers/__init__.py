"""The DeepSeek-V4 building blocks, one concept per file (pure math; no cache storage here)."""
