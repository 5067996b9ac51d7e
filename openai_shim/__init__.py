"""The OpenAI-compatible face of the daemon (`/oai/api/v1`): completions and chat
completions from the base model or a trained adapter's sampler weights."""
