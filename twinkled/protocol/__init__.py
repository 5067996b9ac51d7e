"""The torch-free vocabulary every layer shares: typed requests and results, frames, limits, door checks, errors, checkpoint naming, settings."""
