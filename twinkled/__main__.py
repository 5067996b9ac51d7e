"""`python -m twinkled` is the `twinkled` command."""

from .cli import main

main()
