"""The native Twinkle client (remote or in-process) and its data side."""
