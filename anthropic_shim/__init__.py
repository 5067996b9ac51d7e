"""The Anthropic-compatible face of the daemon (`/anthropic/v1/messages`): Claude-style chat
with the base model or a trained adapter's sampler weights, a thin translation over the
OpenAI face's text path (openai_shim/sampling.py)."""
